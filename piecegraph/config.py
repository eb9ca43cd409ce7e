"""The one configuration object that flows from the public call to every stage."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .program import describe

MODES = ("piecewise", "full", "none", "breakable", "auto")
COMPILERS = ("inductor", "eager")
TOKEN_MIXING = ("exact", "error", "pad")
FULL_COMPILE = ("auto", "whole", "pieces")


def default_capture_sizes(max_tokens: int) -> tuple[int, ...]:
    """``1, 2, 4, 8`` then every multiple of 16 up to ``max_tokens`` (and ``max_tokens`` itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_tokens]
    sizes += list(range(16, max_tokens + 1, 16))
    if max_tokens not in sizes:
        sizes.append(max_tokens)
    return tuple(sizes)


@dataclass(frozen=True)
class Config:
    """How piecegraph traces, splits, compiles and captures a model.

    Frozen: build a new one with :func:`dataclasses.replace`. Validated on construction, so a bad value fails
    where it is written, with the argument's name.

    Attributes:
        mode: ``"piecewise"`` (one CUDA graph per piece between split ops, the default on CUDA), ``"full"`` (one
            graph of the whole compiled model per size, split ops included: for decode), ``"none"`` (compiled
            pieces, no graphs: the CPU path), ``"breakable"`` (no Dynamo: the eager forward captured in segments
            cut at split ops, for models Dynamo cannot trace), ``"auto"`` (piecewise; if tracing fails, the fixes
            piecegraph knows, then piecewise again; else breakable, with one warning naming the blockers;
            naming them runs the doctor's trace, which resets Dynamo's caches, so other torch.compile'd code
            recompiles once).
        split_ops: extra split ops as ``"namespace::name"`` strings or op objects, on top of those declared with
            :func:`piecegraph.split_op`; one split op may be given alone (``split_ops="mylib::attention"``).
        capture_sizes: token counts to capture, a list (``(8,)`` for one size; a bare int is refused: it more
            likely meant ``max_tokens``); default :func:`default_capture_sizes` of ``max_tokens``.
        max_tokens: the largest captured size when ``capture_sizes`` is not given.
        compiler: ``"inductor"`` compiles each piece once for a symbolic token count; ``"eager"`` runs the
            traced pieces as they are.
        token_dim: the dimension of every tensor input that counts tokens (marked dynamic, padded to a size); a
            dim no tensor argument has is refused on the first call.
        copy_outputs: return copies of the outputs (default). ``False`` returns views of graph-owned memory,
            valid only until the next call.
        warmup_runs: eager runs of each size before it is captured.
        check_addresses: on each replay, check that every tensor a graph reads still lives where it was
            captured; a moved one (a replaced parameter) is copied in, with a warning, instead of read stale.
        prewarm: run the model once eagerly before tracing, so JIT kernels build outside Dynamo.
        emulate_graphs: replay by re-running each captured piece on its captured buffers instead of a CUDA
            graph. Graph semantics (static addresses, padding, stale reads) without a GPU: for tests on CPU.
        verify: after capturing a size, replay it on fresh inputs (token inputs rolled by one along the token
            dimension) and compare with the same program run without graphs; a size off by more than
            ``verify_tol`` (relative) is dropped to the no-graph path and reported; verifying every size also
            checks each size's first padded call against the unpadded run. ``None``: on for the first captured
            size in ``mode="auto"``, on for every size in ``mode="breakable"`` (which has no trace in which to
            see token-mixing ops) and for auto's breakable fallback, off otherwise. Catches host values baked
            into a graph and ops that mix padded rows into real ones.
        verify_tol: relative error above which ``verify`` drops a size; ``None`` (default): 1e-4 when the outputs
            are float32 or float64, 5e-2 for half precision (whose rounding differs between kernels and batch sizes).
        token_mixing: what to do when an op outside the split ops mixes rows over the token dimension (a mean
            or softmax over tokens, a convolution along them, attention over all tokens computed in the graph:
            padding would change its result). ``"exact"`` (default): graphs only for calls whose token count
            is a capture size; other calls run the compiled pieces unpadded; one warning names the op and its
            source line. ``"error"``: refuse to trace, naming the op. ``"pad"``: pad anyway (only when you know
            the op named is token-wise after all).
        static_inputs: names of tensor arguments that are not token-aligned (a cross-attention memory, a table):
            never marked dynamic, never padded, even when their dim ``token_dim`` happens to equal the token count.
            Tensors whose dim ``token_dim`` differs from the first tensor argument's are found by themselves.
        pool: a :class:`piecegraph.GraphPool` to share with other compiled models (their captures then reuse
            each other's freed memory; they must not replay at the same time); ``None`` makes a private one.
        compile_sizes: capture sizes that also get pieces compiled by Inductor for that static token count (as
            vLLM's ``compile_sizes``): Inductor's code for a symbolic count can be several times slower than
            code for one size. The one dynamic compile still serves every other size and every call without a
            graph. ``"auto"``: every capture size, each piece's static code kept only where it ran at least 5%
            faster than the dynamic code when timed as a CUDA graph at the size's warm-up (programs that write an
            input, and mode="full", whose graph holds the split ops, keep the static code untimed). Each size
            costs one more Inductor compile of every distinct piece (``stats()["static_compile_s"]``).
            ``"reductions"``: as ``"auto"``, but only for a program that reduces or works along the token dimension
            outside split ops (a per-tensor amax, a softmax over tokens: where the dynamic code is tuned for the
            traced token count and ran 2-15x slower at other counts), and only on CUDA with real graphs, where the
            choice is measured; none otherwise. ``None`` (default): ``"reductions"`` in ``mode="auto"``, ``()``
            (none) in the other modes.
        full_compile: how ``mode="full"`` compiles its one graph with Inductor: ``"whole"``, the traced graph as
            one program; ``"pieces"``, cut at the split ops like piecewise and each piece between them
            compiled (identical layers once, so a 24-layer decoder compiles one layer's pieces, not 24), then the
            pieces and the split ops captured as one CUDA graph per size as before. The same graph at a fraction
            of the compile time, but slower steps (the fusions across the split ops are lost: on the H200 its steps
            of 1-64 rows took 1.68-1.89 ms against 1.56-1.77 ms whole). With ``aot_package`` in the background the
            worker packages the whole graph, and the module swaps it in (its captured sizes captured again) at its
            first call after the worker is done: fused, as ``"whole"``, at the pieces' cold cost; later starts load
            it. Static compiles (``compile_sizes``) use ``"whole"``. ``"auto"`` (default): ``"pieces"`` where that
            swap will come (a cache, ``aot_package`` on, ``aot_background``, and no earlier failed or crashed worker
            of the entry's cache and torch), else ``"whole"``: a cold start of an H100 engine 24 s instead of 55 s,
            its steps as ``"whole"``'s once swapped.
        auto_opaque: when the trace breaks inside an installed library, wrap each public function of it the model
            called (decorators seen through) as an opaque op, its fake inferred by running it at three token
            counts on the arguments prewarm saw and checked at two more, route the model's calls through it, and
            trace again (a function whose output shapes depend on data, or whose fake does not check, is left
            alone, with the reason). One warning and ``stats()["auto_opaque"]`` give each wrapped function's
            ``piecegraph.opaque(...)`` line. ``None`` (default): on in ``mode="auto"`` only; ``True``: in
            ``piecewise``/``full`` too; ``False``: never. Undone by ``piecegraph.unfreeze()`` or when the module
            is released.
        cache_dir: where compiled artifacts are kept between processes (see :mod:`piecegraph.cache`): a folder,
            ``True`` for the default (``$PIECEGRAPH_CACHE_DIR``, else ``$XDG_CACHE_HOME/piecegraph``, else
            ``~/.cache/piecegraph``), ``False`` for none. ``None`` (default): ``$PIECEGRAPH_CACHE_DIR`` when that is
            set, else none: a library does not write under the user's home, nor move Inductor's cache, unasked.
        progress: a progress bar through :meth:`GraphedModule.capture` of several sizes (rich, on stderr). ``None``
            (default): when stderr is a terminal; ``True``: always (rich must be installed); ``False``: never.
        graph_memory_limit: bytes the graphs' shared pool may take. Before capturing, piecegraph estimates each
            size's pool from the traced pieces (:mod:`piecegraph.graphs.memory`); sizes whose estimate is over the
            limit are not captured (they run without graphs), with a warning naming them and the bytes; when even
            the smallest is over, capture is refused with an error. Then, before the first capture (CUDA), one
            more warm-up run of the largest size kept measures its pool (``graph_memory["pool_measured_bytes"]``);
            a size measured over the limit is refused with a warning and runs without graphs, and the next size
            down is measured. ``None`` (default): no limit (the measurement is still made and reported).
        aot_package: with a cache (``cache_dir``), compile each piece (``mode="full"``: the whole graph) by
            exporting it with the token count dynamic and packaging it with AOTInductor, and keep the packages in
            the cache entry. A warm start then loads them through torch's C++ package loader and builds the program
            from the cached trace without importing Dynamo, Inductor or sympy (:mod:`piecegraph.trace.aot_load`).
            Each package is checked against its piece run eagerly before it is used; a piece that cannot be
            exported or packaged (or checked) leaves the program on Inductor's usual code, and the entry without
            packages. Not with static compiles (``compile_sizes``) or a program that writes its inputs. ``None``
            (default): on CUDA with a cache and real graphs; ``True``: wherever a cache is (CPU too); ``False``:
            never.
        aot_background: where ``aot_package`` packages. ``True`` (default): after the setup, in a worker process
            of its own (:mod:`piecegraph.trace.aot_worker`), while this start runs Inductor's usual code: the start
            is ready as soon as without packages, and a start after the worker finished loads them (the state and
            the worker's log are under the cache folder, ``piecegraph cache info``; ``piecegraph.cache.
            wait_packaging`` waits for it). ``False``: in the setup itself, which then takes the packaging's time
            too (on the H200, 0.5B: 94 s on top of a 45 s start) and runs the packages from the start, so that it
            and every warm start run the very same code.
    """

    mode: str = "piecewise"
    split_ops: tuple[Any, ...] = ()
    capture_sizes: tuple[int, ...] | None = None
    max_tokens: int = 512
    compiler: str = "inductor"
    token_dim: int = 0
    copy_outputs: bool = True
    warmup_runs: int = 1
    check_addresses: bool = True
    prewarm: bool = True
    emulate_graphs: bool = False
    verify: bool | None = None
    verify_tol: float | None = None
    token_mixing: str = "exact"
    static_inputs: tuple[str, ...] = ()
    pool: Any = field(default=None, compare=False)
    compile_sizes: tuple[int, ...] | str | None = None
    auto_opaque: bool | None = None
    cache_dir: str | os.PathLike | bool | None = None
    progress: bool | None = None
    graph_memory_limit: int | None = None
    full_compile: str = "auto"
    aot_package: bool | None = None
    aot_background: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={describe(self.mode)} is not one of {MODES}")
        if self.compiler not in COMPILERS:
            raise ValueError(f"compiler={describe(self.compiler)} is not one of {COMPILERS}")
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("warmup_runs", self.warmup_runs, 0)
        _check_int("token_dim", self.token_dim, 0, "dims are counted from the front")
        for name in ("copy_outputs", "check_addresses", "prewarm", "emulate_graphs", "aot_background"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={describe(getattr(self, name))} must be True or False")
        for name in ("verify", "auto_opaque", "progress", "aot_package"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={describe(getattr(self, name))} must be True, False or None")
        tol = self.verify_tol
        if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float)) or not math.isfinite(tol)
                                or tol < 0):
            raise ValueError(f"verify_tol={describe(tol)} must be a finite number >= 0 (a relative error, e.g. 1e-2)")
        if self.full_compile not in FULL_COMPILE:
            raise ValueError(f"full_compile={describe(self.full_compile)} is not one of {FULL_COMPILE}")
        if self.token_mixing not in TOKEN_MIXING:
            raise ValueError(f"token_mixing={describe(self.token_mixing)} is not one of {TOKEN_MIXING}")
        names = (self.static_inputs,) if isinstance(self.static_inputs, str) else self.static_inputs
        if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"static_inputs={describe(self.static_inputs)} must be a list of argument names, e.g. "
                             "static_inputs=('memory',)")
        object.__setattr__(self, "static_inputs", tuple(names))
        object.__setattr__(self, "split_ops", _split_ops(self.split_ops))
        if self.capture_sizes is not None:
            object.__setattr__(self, "capture_sizes", _capture_sizes(self.capture_sizes))
        object.__setattr__(self, "compile_sizes", _compile_sizes(self.compile_sizes, self.sizes))
        cache_dir = self.cache_dir
        if cache_dir is not None and not isinstance(cache_dir, (bool, str, os.PathLike)) or cache_dir == "":
            raise ValueError(f"cache_dir={describe(self.cache_dir)} must be a folder, True (the default folder), "
                             "False (no cache) or None ($PIECEGRAPH_CACHE_DIR if set)")
        if self.graph_memory_limit is not None:
            _check_int("graph_memory_limit", self.graph_memory_limit, 1, "bytes, e.g. 8 << 30 for 8 GiB")
        if self.pool is not None and not hasattr(self.pool, "acquire"):
            raise TypeError(
                f"pool={describe(self.pool)} must be a piecegraph.GraphPool (a raw torch.cuda.graph_pool_handle() "
                f"shares no memory: each model would capture on a stream of its own); pass pool=piecegraph.GraphPool()"
            )

    @property
    def sizes(self) -> tuple[int, ...]:
        """The capture sizes, ascending."""
        return self.capture_sizes or default_capture_sizes(self.max_tokens)

    @property
    def static_compile_sizes(self) -> tuple[int, ...]:
        """The sizes that get a static compile (``compile_sizes``, with ``"auto"`` meaning every capture size); for
        ``"reductions"`` the sizes it may get (the trace decides), for ``None`` none."""
        if self.compile_sizes in ("auto", "reductions"):
            return self.sizes
        return self.compile_sizes or ()

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, **overrides: Any) -> "Config":
        """A config with ``PIECEGRAPH_MODE`` / ``PIECEGRAPH_COMPILER`` applied, then ``overrides``.

        Useful to switch a served model to ``mode=none`` or ``compiler=eager`` while debugging, without editing
        code. (The other variables piecegraph reads are ``PIECEGRAPH_CACHE_DIR``, for ``cache_dir=None``, and
        ``PIECEGRAPH_HF_VERIFY=0``, which skips a Hugging Face model's numeric self-check at load.)
        """
        env: dict[str, Any] = {}
        for var, name in (("PIECEGRAPH_MODE", "mode"), ("PIECEGRAPH_COMPILER", "compiler")):
            if os.environ.get(var) and name not in overrides:
                env[name] = os.environ[var]
                try:
                    cls(**{name: env[name]})
                except ValueError as err:
                    raise ValueError(f"environment variable {var}={env[name]!r}: {err}") from None
        env.update(overrides)
        return cls(**env)


def _check_int(name: str, value: Any, low: int, hint: str = "") -> None:
    # bool is an int subclass; True as a size is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        extra = f" ({hint})" if hint else ""
        raise ValueError(f"{name}={describe(value)} must be an int >= {low}{extra}")


def _compile_sizes(sizes: Any, capture: tuple[int, ...]) -> tuple[int, ...] | str | None:
    # Static code runs only where a size is warmed up and captured, so a size that is never captured is a typo.
    if sizes is None or sizes in ("auto", "reductions"):
        return sizes
    if isinstance(sizes, (int, str, bytes)) or not hasattr(sizes, "__iter__"):
        raise ValueError(f"compile_sizes={describe(sizes)} must be a list of capture sizes, e.g. compile_sizes=(256,),"
                         " 'auto' (every capture size, kept where it measures faster) or 'reductions' (the same, "
                         "for programs that reduce over the token dimension)")
    values = tuple(sorted(set(sizes)))
    stray = [s for s in values if s not in capture]
    if stray:
        raise ValueError(f"compile_sizes={describe(sizes)}: {stray} not among the capture sizes {capture}; static "
                         "code only runs for captured sizes. Add them to capture_sizes or drop them")
    return values


def _capture_sizes(sizes: Any) -> tuple[int, ...]:
    # One int is refused rather than taken as one size: capture_sizes=512 more likely meant max_tokens=512.
    if isinstance(sizes, (int, str, bytes, torch.Tensor)) or not hasattr(sizes, "__iter__"):
        raise ValueError(f"capture_sizes={describe(sizes)} must be a list of positive ints, e.g. capture_sizes=(8,) "
                         "for one size or (1, 8, 64); for every size up to N, pass max_tokens=N instead")
    values = list(sizes)
    bad = [s for s in values if isinstance(s, bool) or not isinstance(s, int) or s < 1]
    if bad or not values:
        raise ValueError(f"capture_sizes={describe(sizes)} must be a non-empty list of positive ints (got "
                         f"{describe(bad) if bad else 'none'})")
    return tuple(sorted(set(values)))


def _split_ops(ops: Any) -> tuple[Any, ...]:
    if ops is None:
        return ()
    if _is_one_op(ops):
        ops = (ops,)  # one split op given alone, as static_inputs takes one name
    elif isinstance(ops, torch.Tensor) or not hasattr(ops, "__iter__"):
        raise ValueError(f"split_ops={describe(ops)} must be a list of split ops ('namespace::name' strings or torch "
                         "ops), e.g. split_ops=('mylib::attention',)")
    ops = tuple(ops)
    for op in ops:  # op objects are named by piecegraph.ops.split; names must at least have the namespace
        if isinstance(op, str) and ("::" not in op or not all(op.split("::"))):
            raise ValueError(f"split_ops entry {op!r} must be written 'namespace::name', e.g. 'mylib::attention'")
        if not _is_one_op(op):
            raise ValueError(f"split_ops entry {describe(op)} is not a split op: pass 'namespace::name' strings or "
                             "torch ops (torch.ops.mylib.attention, an overload, a torch.library.custom_op)")
    return ops


def _is_one_op(value: Any) -> bool:
    """A split op by name or op object: a string, a torch op packet or overload, a ``torch.library.custom_op``."""
    return isinstance(value, (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket)) or isinstance(
        getattr(value, "_qualname", None), str)
