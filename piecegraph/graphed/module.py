"""``GraphedModule``: the object :func:`piecegraph.compile` returns."""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch

from ..adapters.jit_clock import jit_builds
from ..adapters.jit_clock import summarize as jit_summary
from ..cache import compile_cache
from ..cache.session import CacheEntry
from ..config import Config
from ..graphs.capture import capture_batch
from ..graphs.fallback import Advisor, NoAdvice, TraceFixes, trace_or_explain
from ..graphs.progress import capture_bar, summary, wants_bar
from ..ops.auto_opaque import hold_routed
from ..ops.prewarm import prewarm
from ..ops.split import split_op_names
from ..program import TokenCountMismatch, check_token_dim, kept_buffers
from ..runner.flat import FlatRunner
from ..trace.aot_package import PackageRecorder
from ..trace.compile_clock import compile_regions
from .auto import setup_auto
from .binding import (
    Binding,
    arguments_by_name,
    capture_inputs,
    check_capture_tokens,
    positional_names,
    scratch_arguments,
    static_suspect,
)
from .build import (
    Startup,
    TimedAdvisor,
    TraceSnapshot,
    breakable_model,
    package_recorder,
    publish_packages,
    start_background_packaging,
    static_from_mismatch,
    trace_model,
)
from .cached_start import CachedStart, PackagedUpgrade, PendingUpgrade, pending_upgrade
from .weights import WeightWatch

log = logging.getLogger("piecegraph")


class _CallLock:
    """Serializes calls of one GraphedModule: they share static buffers, graphs and the runner's state.

    Re-entrant (a model whose forward calls itself again does not deadlock); copied or pickled as a new lock."""

    def __init__(self) -> None:
        self.lock = threading.RLock()

    def __reduce__(self) -> tuple:
        return (_CallLock, ())


class GraphedModule(CachedStart, PackagedUpgrade, torch.nn.Module):
    """A model traced once by Dynamo, split at its split ops, compiled per piece, replayed as CUDA graphs.

    Inference only: calls run under ``torch.no_grad()``. Calls from several threads are serialized (one at a
    time: they share static buffers and graphs), so they are safe but do not run in parallel. The first call
    traces (with the token dimension of every tensor argument marked dynamic), compiles and builds the runner;
    each capture size is captured on its first use, or all at once with :meth:`capture`. After the trace, calls
    skip Dynamo: the arguments are bound to the graph's inputs directly, so non-tensor arguments must keep their
    traced values (checked), and parameters are read where they lived at capture (moved ones are detected; see
    :meth:`recapture`).
    """

    def __init__(self, model: torch.nn.Module, config: Config, advisor: Advisor | None = None):
        super().__init__()
        self.model = model
        self.config = config
        self._call_lock = _CallLock()
        self._traced_training = model.training
        self._advisor = advisor or NoAdvice()  # auto mode's fixes and blocker names (the doctor's, from compile())
        self._signature = inspect.signature(model.forward)
        self._positional = positional_names(self._signature)
        self._runners: list[FlatRunner] = []
        self._compiled: Callable[..., Any] | None = None
        self._binding: Binding | None = None  # None: calls go through Dynamo (or the eager model)
        self._traced_counts: dict[str, int] = {}  # each tensor argument's dim token_dim at the trace
        self._weights = WeightWatch(model)
        self._trace_fixes: TraceFixes | None = None  # what automatic opaque wrapped (routes undone on release)
        self._startup = Startup()
        self._trace_source: GraphedModule | None = None  # trace_from(): whose trace this module's program reuses
        self._shares_trace = False  # another module reuses this one's trace: keep its snapshot
        self._snapshot: TraceSnapshot | None = None
        self._packages: PackageRecorder | None = None  # a cold start's AOTInductor packages (trace/aot_package.py)
        self._upgrade: PendingUpgrade | None = None  # pieces to swap for the worker's whole-graph package

    def __deepcopy__(self, memo: dict) -> GraphedModule:
        """A copy of the model, compiled anew on its first call (compiled code and graphs are not copied)."""
        return GraphedModule(copy.deepcopy(self.model, memo), self.config, self._advisor)

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self._compiled is not None:
            raise TypeError(
                "a GraphedModule that has run holds compiled code and CUDA graphs, which cannot be pickled; pickle "
                "its .model (or its state_dict) and call piecegraph.compile again after loading"
            )
        return super().__reduce_ex__(protocol)

    @property
    def runner(self) -> FlatRunner:
        if not self._runners:
            raise RuntimeError("the model has not been traced yet: call it once (or call .capture(...))")
        return self._runners[-1]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        values = self._arguments(args, kwargs)
        # no_grad only where grad is on: entering it costs microseconds a small graph's replay feels
        with self._call_lock.lock, (torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext()):
            if self._compiled is not None and self._model_changed():
                log.warning("piecegraph: the model changed since it was traced (structure or train/eval mode); "
                            "tracing it again")
                self._reset()
            if self._compiled is None:
                self._setup_or_reset(values)
            if self._upgrade is not None and time.monotonic() >= self._upgrade.next_check:
                self._poll_upgrade()
            if self._binding is None:
                return self._compiled(**values)
            try:
                return self._binding.pack(self.runner(*self._binding.flatten(values)))
            except TokenCountMismatch as err:
                if not self._retrace_with_static(values, err):
                    raise
            return self._binding.pack(self.runner(*self._binding.flatten(values)))

    def _retrace_with_static(self, values: dict[str, Any], err: TokenCountMismatch) -> bool:
        """A tensor taken for a token input on the first call kept its size while the token count changed: it is
        static. Trace again with it in ``Config.static_inputs``. False when nothing explains the mismatch so."""
        kept = static_from_mismatch(err, values, self.runner.names, self._traced_counts)
        if not kept:
            return False
        log.warning("piecegraph: %s kept its size while the token count changed: a static input, not a token "
                    "input; tracing again with Config(static_inputs=%r)", ", ".join(sorted(kept)),
                    tuple(sorted(kept)))
        self.config = self.config.replace(static_inputs=tuple(self.config.static_inputs) + tuple(sorted(kept)))
        self._reset()
        self._setup_or_reset(values)
        return True

    def _model_changed(self) -> bool:
        """A trace is stale when the model switched train/eval mode or its parameters' structure changed (a
        replaced parameter of the same shape is re-read instead: :class:`~piecegraph.graphed.weights.WeightWatch`)."""
        return self.model.training != self._traced_training or self._weights.changed(self._runners)

    def _arguments(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        if not kwargs and self._positional is not None and len(args) == len(self._positional):
            return dict(zip(self._positional, args))  # every argument given by position: what bind would return
        return arguments_by_name(self._signature, type(self.model).__name__, args, kwargs)

    # -- setup ------------------------------------------------------------------------------------------
    def _setup_or_reset(self, values: dict[str, Any]) -> None:
        try:
            self._setup(values)
        except BaseException:
            self._reset()  # a failed setup leaves the module as if it had never been called
            raise

    def _setup(self, values: dict[str, Any]) -> None:
        """Prewarm, trace (or probe), bind. Every run here is piecegraph's own: it runs on copies of the caller's
        tensors, and the model's buffers are restored afterwards, so the call that follows is the only one the
        caller's data and the model's visible state see."""
        td = self.config.token_dim
        check_token_dim(values, td, self.config.static_inputs)
        self._traced_training = self.model.training
        self._traced_counts = {k: v.shape[td] for k, v in values.items()
                               if isinstance(v, torch.Tensor) and v.dim() > td}
        split_op_names(self.config.split_ops)  # a misspelt split op fails here, in plain words, not inside Dynamo
        self._startup = Startup()
        start = time.perf_counter()
        with jit_builds() as builds, compile_regions(self._startup.compile_regions), \
                compile_cache(self.model, values, self.config, self._startup.cache) as entry:
            self._setup_stages(values, entry)
            publish_packages(self._packages, self._runners, self._trace_fixes is None, entry, self._startup.cache)
            self._packages = None
        packaging = start_background_packaging(entry, self._startup.cache)
        by_pieces = any(runner.program.by_pieces for runner in self._runners)
        self._upgrade = pending_upgrade(by_pieces, entry, values) if packaging else None
        self._startup.jit.extend(builds)
        self._startup.setup_s = time.perf_counter() - start
        held = hold_routed()  # Dynamo may have traced through another module's automatic opaque routes
        if held.ops:
            weakref.finalize(self, held.undo)

    def _setup_stages(self, values: dict[str, Any], entry: CacheEntry) -> None:
        """Prewarm, then trace (or load the cache's traced program) and compile as the mode says (timed into
        ``self._startup``)."""
        mode = self.config.mode
        with kept_buffers(self.model):
            if self.config.prewarm:
                self._startup.prewarm_s = prewarm(self.model, **scratch_arguments(values)).seconds
            if self._load_packages(values, entry):
                return
            if mode != "breakable":  # breakable runs no Dynamo and no Inductor
                self._startup.compiler_import_s = _import_compiler_stack()
            entry.compiling()
            if mode != "breakable" and self.config.compiler == "inductor":
                _start_compile_pool()
            self._packages = package_recorder(self.config, values, entry)
            if mode == "breakable":  # no trace to see token-mixing ops in: verify unless told otherwise
                verify = True if self.config.verify is None else self.config.verify
                self._setup_breakable(values, self.config.replace(verify=verify))
            elif mode == "auto":
                if not self._load_trace(entry):
                    self._setup_auto(values, entry)
            elif not self._load_trace(entry) and not self._load_shared(entry):
                # Dynamo's failure: automatic opaque when Config says, else piecegraph's error naming the fix
                snapshots: list | None = [] if entry.enabled or self._shares_trace else None
                advisor = TimedAdvisor(self._advisor, self._startup)
                self._keep_fixes(trace_or_explain(
                    self.model, lambda: scratch_arguments(values), self.config, advisor,
                    lambda: self._try_trace(values, self.config, None, snapshots)))
                self._keep_trace(entry, snapshots)

    def _setup_auto(self, values: dict[str, Any], entry: CacheEntry) -> None:
        snapshots: list | None = [] if entry.enabled or self._shares_trace else None
        fixed = setup_auto(self.model, values, self.config, TimedAdvisor(self._advisor, self._startup),
                           lambda v, c, vs: self._try_trace(v, c, vs, snapshots), self._setup_breakable)
        self._keep_fixes(fixed)
        if fixed is None and self._compiled is not self.model:  # piecewise at once (no fixes, not breakable)
            self._keep_trace(entry, snapshots)

    def _keep_fixes(self, fixed: TraceFixes | None) -> None:
        """Keep what automatic opaque wrapped (for stats()); its routes are undone when this module is released."""
        if fixed is not None and fixed.wrapped:
            self._trace_fixes = fixed
            weakref.finalize(self, fixed.release)

    def _trace(self, values: dict[str, Any], config: Config, verify_sizes: float | None = None,
               snapshots: list | None = None) -> None:
        """Trace with Dynamo once (:func:`~piecegraph.graphed.build.trace_model`) and bind; a tensor the trace shows
        is not a token input is added to the static inputs (this module's config too) and the model traced again."""
        while True:
            if self._packages is not None:
                self._packages.reset()  # a program traced again is packaged anew
            try:
                self._compiled, self._binding = trace_model(self.model, values, config, self._runners, verify_sizes,
                                                            self._startup, snapshots, self._packages)
                break
            except Exception as err:  # noqa: BLE001  (Dynamo wraps the backend's error)
                static = static_suspect(err, values, config.token_dim, config.static_inputs)
                if static is None:
                    raise
                log.warning("piecegraph: %s was taken for a token input (its dim %d equals the token count) but "
                            "the trace shows it is not; tracing again with Config(static_inputs=(%r,))", static,
                            config.token_dim, static)
                self._runners.clear()
                self.config = self.config.replace(static_inputs=(*self.config.static_inputs, static))
                config = config.replace(static_inputs=(*config.static_inputs, static))
        if self._binding is not None:
            self._weights.bind(self._binding)

    def _setup_breakable(self, values: dict[str, Any], config: Config, graphs: bool | None = None) -> None:
        """No Dynamo: the eager model, captured in segments cut at split ops (see graphs/breakable.py)."""
        runner, self._binding = breakable_model(self.model, values, config, graphs)
        self._runners.append(runner)
        self._compiled = self.model
        self._weights.bind(self._binding, traced=False)

    def _try_trace(self, values: dict[str, Any], config: Config, verify_sizes: float | None,
                   snapshots: list | None = None) -> Exception | None:
        try:
            self._trace(values, config, verify_sizes, snapshots)
            return None
        except Exception as error:  # Dynamo raises many types; each is a reason to fall back, not to crash
            self._reset()
            return error

    def _reset(self) -> None:
        self._upgrade = None
        self._runners.clear()
        self._compiled = None
        self._binding = None
        self._weights.unbind()

    # -- after setup ------------------------------------------------------------------------------------
    def recapture(self) -> None:
        """Drop every captured graph (after replacing weights); sizes capture again on their next use."""
        if self._binding is not None:
            self._weights.refresh(self._runners)
        for runner in self._runners:
            runner.drop_graphs()

    def capture(self, make_inputs: Callable[[int], tuple[tuple[Any, ...], Any]],
                sizes: Iterable[int] | None = None) -> dict[int, float]:
        """Capture ``sizes`` (default: all capture sizes), largest first, into the shared pool.

        ``make_inputs(n)`` returns ``(args, context)``: a tuple (or list) of the forward's arguments for ``n``
        tokens (every token input ``n`` long in dim ``token_dim``) and the forward context metadata to run them
        with (``None`` for none). Dummy values are fine as long as the split ops accept them. Anything else is
        refused, naming ``make_inputs``, the size and what it returned. Returns the seconds each size took.
        Several sizes show a progress bar (``Config.progress``); the start-up summary is logged at INFO.
        """
        sizes = sorted(sizes or self.config.sizes, reverse=True)
        with jit_builds() as builds, capture_bar(self.config.progress, sizes) as update:
            self._capture_sizes(make_inputs, sizes, update)
        if self._upgrade is not None:  # the program swapped in later captures the sizes with these inputs again
            self._upgrade.make_inputs = make_inputs
        self._startup.jit.extend(builds)  # a setup inside the first size recorded into this block's list
        if len(sizes) > 1:
            line = summary(self.stats()["startup"])
            log.info(line)
            if wants_bar(self.config.progress, len(sizes)):  # the bar's reader sees where the seconds went
                print(line, file=sys.stderr)
        return {s: self.runner.capture_s.get(s, 0.0) for s in sizes}

    def _capture_sizes(self, make_inputs: Callable[[int], Any], sizes: list[int],
                       update: Callable[[int, int], None] | None = None) -> None:
        from ..context import forward_context

        with capture_batch():
            for done, n in enumerate(sizes):
                if update is not None:
                    update(n, done)
                args, meta = capture_inputs(make_inputs, n)
                check_capture_tokens(self._arguments(args, {}), n, self.config)
                with forward_context(meta) if meta is not None else contextlib.nullcontext():
                    self(*args)

    @contextlib.contextmanager
    def without_graphs(self) -> Iterator[None]:
        """Run the same compiled pieces without graphs inside the block (debugging, references)."""
        with contextlib.ExitStack() as stack:
            for runner in self._runners:
                stack.enter_context(runner.graphs_off())
            yield

    def stats(self) -> dict[str, Any]:
        """``sizes``, ``pieces``, ``capture_s`` per size, ``pool_bytes``, ``replays``, ``fallbacks`` and more."""
        stats = self.runner.stats()
        stats["recompiles"] = len(self._runners) - 1
        stats["startup"] = self.startup_report(stats)
        if self._trace_fixes is not None:  # each function automatic opaque wrapped: its piecegraph.opaque line
            stats["auto_opaque"] = dict(self._trace_fixes.wrapped)
        return stats

    def startup_report(self, stats: dict[str, Any] | None = None) -> dict[str, Any]:
        """Seconds per start-up stage (see :class:`~piecegraph.graphed.build.Startup`), capture seconds over every size,
        ``ready_s`` (setup + capture), the pool's bytes, and the cache's doing. ``import_s``: what
        ``import piecegraph`` took in this process (torch included when piecegraph imported it first)."""
        # Read, not imported: the package's __init__ sits above this stage and sets IMPORT_S once, at its end
        import_s = getattr(sys.modules.get("piecegraph"), "IMPORT_S", None)
        stats = stats or self.runner.stats()
        s = self._startup
        capture = sum(stats["capture_s"].values())
        return {"import_s": import_s, "compiler_import_s": s.compiler_import_s, "prewarm_s": s.prewarm_s,
                "trace_s": s.trace_s, "compile_s": s.compile_s, "diagnose_s": s.diagnose_s,
                "setup_s": s.setup_s, "capture_s": capture, "ready_s": s.setup_s + capture,
                **jit_summary(s.jit), "num_sizes": len(stats["capture_s"]), "pool_bytes": stats["pool_bytes"],
                "pool_estimate_bytes": stats.get("graph_memory", {}).get("pool_estimate_bytes"),
                "pool_measured_bytes": stats.get("graph_memory", {}).get("pool_measured_bytes"),
                "compile_regions": dict(s.compile_regions), **s.cache}


def _start_compile_pool() -> None:
    """Start Inductor's pool of kernel-compile processes now, as torch.compile's own inductor backend does when it
    is looked up (piecegraph's backend calls Inductor directly, so nothing did): each worker imports torch, seconds
    of every core that then overlap the trace rather than stall the first compile. A no-op without Triton, with
    one compile thread (a warm entry's in-process loads; ``TORCHINDUCTOR_COMPILE_THREADS=1``), or once started."""
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # a torch without it: the pool starts at the first kernel, as before
        return
    maybe_warm_pool()


def _import_compiler_stack() -> float:
    """Seconds to import Dynamo and Inductor (0 once imported): timed apart, since a warm start that loads every
    compiled piece still imports them (1.7 s on CI's CPU), and it would otherwise hide in the cache's load."""
    start = time.perf_counter()
    import torch._dynamo  # noqa: F401
    import torch._inductor.codecache  # noqa: F401

    return time.perf_counter() - start
