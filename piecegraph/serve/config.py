"""The serving engine's one configuration object (frozen, validated where it is written)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from piecegraph.config import FULL_COMPILE

ENGINE_MODES = ("eager", "breakable", "piecewise", "auto")
COMPILERS = ("inductor", "eager")


def serve_sizes(limit: int) -> tuple[int, ...]:
    """Capture sizes up to ``limit``: ``1, 2, 4, 8``, then steps of about 1.5x (16, 24, 32, 48, 64, 96, ...)
    and ``limit`` itself. A step of ``n`` tokens then pads by at most a third (at most 2x below 16)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= limit]
    base = 16
    while base <= limit:
        sizes += [s for s in (base, base * 3 // 2) if s <= limit]
        base *= 2
    if limit not in sizes:
        sizes.append(limit)
    return tuple(sorted(set(sizes)))


@dataclass(frozen=True)
class EngineConfig:
    """How the continuous-batching engine schedules steps and which graphs it replays.

    Attributes:
        mode: ``"eager"`` (the model as written, no compile), ``"breakable"`` (piecegraph breakable capture for
            every step: no Dynamo), ``"piecewise"`` (piecewise graphs for every step), ``"auto"`` (full graphs
            for pure decode steps, piecewise graphs for every other step, one shared ``GraphPool``).
        max_num_seqs: most requests running at once (the largest decode batch; full graphs are captured up to it).
        max_num_batched_tokens: the per-step token budget; prefills longer than what is left are chunked.
            Piecewise graphs are captured up to ``max(max_num_batched_tokens, max_num_seqs)``.
        num_pages: pages of the paged KV cache, the scratch page included; ``None`` = room for ``max_num_seqs``
            sequences of ``max_seq_len`` tokens (no preemption then) when that fits in ``kv_cache_memory``, else
            what fits there (``serve/kv_budget.py``). Smaller budgets preempt (recompute).
        kv_cache_memory: the fraction of the device memory free at engine start (weights loaded) that a cache
            sized by default may take (CUDA only; the rest is for graphs, activations and kernel workspaces).
        page_size: tokens per KV page.
        max_seq_len: the longest request (prompt + new tokens); ``None`` = the model config's ``max_seq_len``. It
            fixes the width of the device page table and of the dense decode page tables gathered from it (and
            read by the torch backend's decode attention): keep it tight.
        decode_sizes / prefill_sizes: capture sizes of the full (decode) and piecewise graphs; ``None`` =
            :func:`serve_sizes` up to the limits above. Steps above the largest size run without graphs.
        compiler: ``"inductor"`` or ``"eager"`` (piecegraph's ``compiler``: the traced pieces as they are).
        emulate_graphs: piecegraph's CPU emulation of graph replay (graph semantics for tests, no GPU needed).
        attention_backend: the KV cache's backend (``"auto" | "torch" | "flashinfer"``); ``None`` = the model's.
        overlap: overlapped steps (default): the engine schedules and launches step k+1 before it reads step k's
            tokens, which stay on the device as step k+1's input ids; the host learns them one step later (a
            request that stopped runs one extra decode row, discarded). ``False``: the synchronous loop, each
            step's tokens read before the next is scheduled (the baseline). Tokens are equal either way.
        freeze_gc: the engine's own loops (``run``, ``generate``, the server's loop; serve-bench's clients) freeze
            the heap that exists when they start and unfreeze it when they end (``serve/gc_pauses.py``), so
            Python's full collections walk only what serving made, not the compiler's hundreds of thousands of
            objects (150-420 ms pauses measured at c=1024 without). Off by default until a GPU serve-bench shows
            it (its ``auto-freeze`` row).
        full_compile: how auto's full (decode) module compiles its graph (``piecegraph.Config.full_compile``):
            ``"whole"``, one Inductor program of the whole decoder; ``"pieces"``, the pieces between attention
            calls compiled as the piecewise module compiles them (identical layers once, the same Inductor cache
            entries), then captured whole as before: a fraction of the compile time (the whole program was 25-29
            s of the 0.5B auto engine's 36 s start on the H200), steps slower until the whole graph's package is
            swapped in (``cache_dir`` with background packaging; 1.16x the output tok/s after the swap at c=256 on
            an H100). ``"auto"`` (default): ``"pieces"`` where that swap will come, else ``"whole"``.
        share_trace: auto's full module builds its program from the piecewise module's Dynamo trace
            (``GraphedModule.trace_from``) instead of tracing the model a second time (3.7 s of the 0.5B start);
            where that trace cannot be shared it traces as before. The full module then takes the piecewise
            module's compiled pieces too where it compiles by pieces (``piecegraph/trace/handover.py``): it set up
            in 1.7 s instead of 25.7 on CPU. On by default (on an H100: the same greedy tokens, and the same
            steps once swapped); ``False`` traces twice.
        cache_dir: piecegraph's artifact cache for the engine's modules (:class:`piecegraph.Config` ``cache_dir``:
            a folder, ``True`` for the default folder, ``False`` off, ``None``: ``$PIECEGRAPH_CACHE_DIR`` if set).
        aot_package: with a cache, keep AOTInductor packages of the modules' compiled pieces in it, so a warm
            start imports no compiler (``piecegraph.Config(aot_package=...)``; ``None``: on CUDA).
        aot_background: package in a worker process after the setup (default), not in it
            (``piecegraph.Config(aot_background=...)``).
        graph_memory_limit: bytes the graphs may take (``piecegraph.Config``): sizes whose estimate, or whose
            measurement before capture, is over it are left out, named in a warning, and run without graphs.
            ``None``: no limit.
        auto_opaque: wrap each library function that stops Dynamo (a JIT kernel nobody adapted, such as
            FlashInfer's FP8 GEMMs) as an opaque op, as ``piecegraph.Config(auto_opaque=...)`` does, in the
            engine's piecewise and full modules. ``None`` (default): on in ``mode="auto"`` (piecegraph's auto),
            off in ``"piecewise"``, whose modules then refuse such a model naming the fix; ``True`` / ``False``:
            on / off in both.
        prefix_cache: automatic prefix caching (default on): full KV pages of computed tokens are kept by a hash
            chain of their tokens after their requests end, and a request whose prompt starts with cached pages
            shares them and prefills only the rest; unreferenced cached pages are evicted least recently used
            first when pages run short (``serve/prefix_cache.py``). Tokens are equal either way.
        decode_compile_sizes: ``"auto"``: auto's full (decode) module also compiles each capture size for its
            static token count and keeps it where it ran faster (``piecegraph.Config.compile_sizes="auto"``; the
            bench's ``full-static`` row: 1.654 ms against the dynamic 1.901 at batch 1 on the 1B shape, H100), at
            an Inductor compile per size at start. ``None`` (default): one dynamic-shape compile.
        mixed_graphs: in ``mode="auto"``, steps with prompt tokens in them (prefill and mixed steps) of at most the
            attention backend's ``mixed_graph_seqs(size)`` sequences replay full graphs too, captured at the
            piecewise sizes, where the backend can capture such steps (FlashInfer: ``flashinfer_mixed.py``; the
            torch backend cannot, and keeps them piecewise). A third module (``"full-mixed"`` in the step kinds);
            per size, auto times it against the piecewise module on a prompt beside decode rows at start and keeps
            the faster (on CUDA; elsewhere the full graph).

    Example: ``EngineConfig(mode="auto", max_num_seqs=64, max_num_batched_tokens=512, max_seq_len=1024)``.
    """

    mode: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    num_pages: int | None = None
    kv_cache_memory: float = 0.85
    page_size: int = 16
    max_seq_len: int | None = None
    decode_sizes: tuple[int, ...] | None = None
    prefill_sizes: tuple[int, ...] | None = None
    compiler: str = "inductor"
    emulate_graphs: bool = False
    attention_backend: str | None = None
    overlap: bool = True
    freeze_gc: bool = False
    full_compile: str = "auto"
    share_trace: bool = True
    cache_dir: Any = None
    aot_package: bool | None = None
    aot_background: bool = True
    graph_memory_limit: int | None = None
    auto_opaque: bool | None = None
    prefix_cache: bool = True
    decode_compile_sizes: str | None = None
    mixed_graphs: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ENGINE_MODES:
            raise ValueError(f"EngineConfig.mode={self.mode!r} is not one of {ENGINE_MODES}")
        if self.compiler not in COMPILERS:
            raise ValueError(f"EngineConfig.compiler={self.compiler!r} is not one of {COMPILERS}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size"):
            _check_int(name, getattr(self, name), 1)
        if self.num_pages is not None:
            _check_int("num_pages", self.num_pages, 2)
        if self.max_seq_len is not None:
            _check_int("max_seq_len", self.max_seq_len, 1)
        fraction = self.kv_cache_memory
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"EngineConfig.kv_cache_memory={fraction!r} must be a fraction in (0, 1], e.g. 0.85")
        for name in ("decode_sizes", "prefill_sizes"):
            sizes = getattr(self, name)
            if sizes is not None:
                values = tuple(sorted(set(sizes)))
                if not values or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in values):
                    raise ValueError(f"EngineConfig.{name}={sizes!r} must be a non-empty list of positive ints")
                object.__setattr__(self, name, values)
        for name in ("emulate_graphs", "overlap", "freeze_gc", "share_trace", "aot_background", "prefix_cache",
                     "mixed_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)!r} must be True or False")
        if self.full_compile not in FULL_COMPILE:
            raise ValueError(f"EngineConfig.full_compile={self.full_compile!r} is not one of {FULL_COMPILE}")
        if not (self.auto_opaque is None or isinstance(self.auto_opaque, bool)):
            raise ValueError(f"EngineConfig.auto_opaque={self.auto_opaque!r} must be None, True or False")
        if self.graph_memory_limit is not None:
            _check_int("graph_memory_limit", self.graph_memory_limit, 1)
        if self.decode_compile_sizes not in (None, "auto"):
            raise ValueError(f"EngineConfig.decode_compile_sizes={self.decode_compile_sizes!r} must be None or "
                             "'auto'")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (bool, str, os.PathLike)) \
                or self.cache_dir == "":
            raise ValueError(f"EngineConfig.cache_dir={self.cache_dir!r} must be a folder, True (the default "
                             "folder), False (no cache) or None ($PIECEGRAPH_CACHE_DIR if set)")

    @property
    def step_tokens(self) -> int:
        """The most tokens one step can hold (a prefill budget, or a full decode batch)."""
        return max(self.max_num_batched_tokens, self.max_num_seqs)

    @property
    def full_sizes(self) -> tuple[int, ...]:
        """Capture sizes of the decode (full) graphs."""
        return self.decode_sizes or serve_sizes(self.max_num_seqs)

    @property
    def piecewise_sizes(self) -> tuple[int, ...]:
        """Capture sizes of the piecewise (and breakable) graphs."""
        return self.prefill_sizes or serve_sizes(self.step_tokens)

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"EngineConfig.{name}={value!r} must be an int >= {low}")
