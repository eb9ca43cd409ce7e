"""Per-size capture and replay of one compiled piece, sharing one memory pool.

A :class:`GraphedPiece` stands where a compiled piece sat in the split graph. The runner that owns it sets the
shared :class:`CaptureState` (phase and size) before each call; the piece then runs, warms up, captures or
replays. Outputs of captured pieces are kept only as non-owning aliases, so the pool memory of a size can be
reused by the next (smaller) size captured into the same pool, as every size replays alone.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator
from unittest import mock

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from ..context import forward_context
from ..program import CaptureState, Phase

log = logging.getLogger("piecegraph")


@dataclass
class CapturedPiece:
    graph: Any  # torch.cuda.CUDAGraph, or None when emulated
    inputs: list[Any]  # the arguments as captured (aliases of their memory)
    tensor_idx: tuple[int, ...]
    ptrs: list[int]  # each tensor argument's address at capture
    outputs: Any
    fn: Callable[..., Any] | None = None  # what was captured (the size's static compile or the dynamic one)
    warned: set[int] = field(default_factory=set)


def weak_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor viewing ``t``'s memory without keeping it alive (CUDA only; CPU tensors are returned as is).

    Keeping strong references to every size's intermediate outputs would stop sizes from sharing the pool.
    """
    if not t.is_cuda:
        return t
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(alias, t.storage_offset(), t.size(), t.stride())


@contextlib.contextmanager
def capture_session() -> Iterator[None]:
    """Skip the ``gc.collect()`` and ``empty_cache()`` that ``torch.cuda.graph`` runs before every capture.

    With dozens of pieces times dozens of sizes they dominate capture time; one collection up front suffices.
    """
    import gc

    gc.collect()
    with mock.patch("gc.collect", lambda *a, **k: 0), mock.patch("torch.cuda.empty_cache", lambda: None):
        yield


def capture_batch() -> contextlib.AbstractContextManager[None]:
    """Around capturing several sizes (``GraphedModule.capture``, an engine's start): one ``gc.collect()`` for
    them all instead of one per size (each :func:`capture_session` inside finds it already patched). A process
    that has compiled holds ~500k Python objects: a full collection costs 0.1-0.4 s, so 40 sizes paid seconds.
    A no-op without CUDA (nothing is captured for real)."""
    return capture_session() if torch.cuda.is_available() else contextlib.nullcontext()


class GraphedPiece:
    """A compiled piece with one captured graph per size.

    ``fn`` must be compiled for a symbolic token count (or be the traced FX module); it is called with the
    piece's arguments. ``static`` maps sizes to the piece compiled for that token count (``compile_sizes``):
    warm-up and capture of such a size use it, unless ``measure`` (``compile_sizes="auto"``) timed both on the
    GPU at warm-up and the dynamic code was not slower. Runs without graphs always use ``fn``. In ``REPLAY`` the
    arguments must live where they lived at capture; those that moved are copied into the captured buffers (with
    a warning) when ``state.check_addresses``, else read stale.
    """

    def __init__(self, name: str, fn: Callable[..., Any], state: CaptureState,
                 static: dict[int, Callable[..., Any]] | None = None, measure: bool = False):
        self.name = name
        self.fn = fn
        self.state = state
        self.captured: dict[int, CapturedPiece] = {}
        self.static = dict(static or {})
        self.measure = measure
        self.choice: dict[int, str] = {}  # size -> "static" | "dynamic", fixed at the size's first warm-up
        self.timings: dict[int, tuple[float, float]] = {}  # size -> (static ms, dynamic ms), when measured

    def __call__(self, *args: Any) -> Any:
        phase = self.state.phase
        if phase is Phase.REPLAY:
            return self._replay(self.captured[self.state.size], args)
        if phase is Phase.CAPTURE:
            return self._capture(args)
        if phase is Phase.WARMUP:
            return self._for_size(args)(*args)
        return self.fn(*args)

    def _for_size(self, args: tuple[Any, ...]) -> Callable[..., Any]:
        """The code this size warms up and captures: its static compile, if it has one and it won."""
        size = self.state.size
        if size not in self.static:
            return self.fn
        if size not in self.choice:
            self.choice[size] = self._pick(size, args)
        return self.static[size] if self.choice[size] == "static" else self.fn

    def _pick(self, size: int, args: tuple[Any, ...]) -> str:
        if not self.measure or self.state.emulate or not torch.cuda.is_available():
            return "static"
        static_ms, dynamic_ms = graph_ms(self.static[size], args), graph_ms(self.fn, args)
        self.timings[size] = (static_ms, dynamic_ms)
        # Keep the dynamic code on a near tie: its kernels are shared by every size (fewer to warm, less memory).
        return "static" if static_ms < 0.95 * dynamic_ms else "dynamic"

    def drop(self) -> None:
        """Forget every captured graph (their pool memory returns to the pool's owner)."""
        self.captured.clear()

    def _capture(self, args: tuple[Any, ...]) -> Any:
        state = self.state
        fn = self._for_size(args)
        tensor_idx = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        if state.emulate:
            out = fn(*args)
            # Views pin the captured memory like a graph does, even if an argument is later re-pointed.
            inputs = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
            entry = CapturedPiece(None, inputs, tensor_idx, _ptrs(args, tensor_idx), out, fn)
        else:
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=state.pool, stream=state.stream):
                    out = fn(*args)
            except Exception:
                repair_rng_after_failed_capture()
                raise
            graph.replay()  # capture records without running: make this call's outputs real
            inputs = [weak_alias(a) if isinstance(a, torch.Tensor) else a for a in args]
            entry = CapturedPiece(
                graph, inputs, tensor_idx, _ptrs(args, tensor_idx), tree_map_only(torch.Tensor, weak_alias, out), fn
            )
        self.captured[state.size] = entry
        return out

    def _replay(self, entry: CapturedPiece, args: tuple[Any, ...]) -> Any:
        if self.state.check_addresses and _ptrs(args, entry.tensor_idx) != entry.ptrs:
            self._copy_moved_inputs(entry, args)
        if entry.graph is not None:
            entry.graph.replay()
            return entry.outputs
        fresh = (entry.fn or self.fn)(*entry.inputs)
        copy_into(entry.outputs, fresh)
        return entry.outputs

    def _copy_moved_inputs(self, entry: CapturedPiece, args: tuple[Any, ...]) -> None:
        for i in entry.tensor_idx:
            if args[i].data_ptr() == entry.inputs[i].data_ptr():
                continue
            if i not in entry.warned:
                entry.warned.add(i)
                warnings.warn(
                    f"piecegraph: input {i} of {self.name} (shape {tuple(args[i].shape)}) moved since size "
                    f"{self.state.size} was captured (a replaced parameter or buffer?). It is copied into the "
                    "captured buffer on every replay, which is slow: call GraphedModule.recapture() after "
                    "replacing weights.",
                    stacklevel=4,
                )
            entry.inputs[i].copy_(args[i])
        self.state.moved_inputs += 1


def time_ms(fn: Callable[[int], Any], warmup: int = 3, repeats: int = 20) -> float:
    """Median milliseconds of ``fn(i)`` over ``repeats`` calls after ``warmup`` calls (the bench's timer, and the
    engine's when it picks a graph kind per size).

    ``i`` counts calls so the caller can rotate inputs (a replay of identical inputs could hide copy cost). On
    CUDA each call is bracketed by events and synchronized, so the time is the step's device time including
    any CPU launch gap; on CPU it is wall time.
    """
    for i in range(warmup):
        fn(i)
    cuda = torch.cuda.is_available()
    times = []
    for i in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(i)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def pipelined_ms(fn: Callable[[int], Any], warmup: int = 2, repeats: int = 20) -> float:
    """Milliseconds per call of ``fn(i)`` called ``repeats`` times back to back, no sync in between (after
    ``warmup`` calls): the pace of a loop that launches the next step while the device runs this one, that is
    the slower of the host's work per call and the device's. On CUDA between two events (the device's wait for
    a slow host is in it); on CPU wall time."""
    for i in range(warmup):
        fn(i)
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for i in range(repeats):
            fn(i)
        return (time.perf_counter() - t0) * 1e3 / repeats
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(repeats):
        fn(i)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def step_ms(module: Callable[..., Any], inputs: tuple[tuple[Any, ...], Any], repeats: int = 5) -> float:
    """Median milliseconds of ``module(*args)`` under ``meta``'s forward context, ``inputs = (args, meta)`` (what
    ``GraphedModule.capture``'s ``make_inputs(n)`` returns), by :func:`time_ms` after one warm call: a step's
    time with its graphs already captured, host launch gaps included. Used where a step's module is chosen by
    measurement (the engine's auto decode choice, the bench's auto row)."""
    args, meta = inputs

    def step(_: int) -> None:
        with forward_context(meta):
            module(*args)

    return time_ms(step, warmup=1, repeats=repeats)


def graph_ms(fn: Callable[..., Any], args: tuple[Any, ...], repeats: int = 5) -> float:
    """Median GPU milliseconds of ``fn(*args)`` captured alone in a throwaway CUDA graph and replayed ``repeats``
    times (CUDA events), after one warm run. Timed as a graph, because a graph is what will run: timing eager
    calls measures their launch overhead, which hides the kernels' difference until thousands of tokens (measured
    on an H200: 1.3-3.5 ms of eager time for 0.15 ms of graph). Only for pieces that write none of their inputs:
    each run repeats the piece's work on the same arguments."""
    fn(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph  # its private pool goes back to the allocator
    return sorted(times)[len(times) // 2]


def _ptrs(args: Any, idx: tuple[int, ...]) -> list[int]:
    return [args[i].data_ptr() for i in idx]  # a list comprehension: every replay pays for this


def copy_into(dst: Any, src: Any) -> None:
    """Copy each tensor of ``src`` into the tensor at the same place in ``dst`` (a captured output) unless they
    already share memory: what a replay must do for a piece or function that returns fresh tensors."""
    for d, s in zip(tree_flatten(dst)[0], tree_flatten(src)[0]):
        if isinstance(d, torch.Tensor) and d.data_ptr() != s.data_ptr():
            d.copy_(s)


def repair_rng_after_failed_capture() -> None:
    """Give the CUDA generator a fresh state (same seed and offset) after a capture that failed midway.

    A capture whose ``capture_end`` fails never runs the generator's capture epilogue, and every later random op
    in the process then fails with "Offset increment outside graph capture".
    """
    if not torch.cuda.is_available():
        return
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    if hasattr(gen, "graphsafe_set_state") and hasattr(gen, "clone_state"):
        gen.graphsafe_set_state(gen.clone_state())


class GraphPool:
    """A CUDA graph memory pool that several compiled models share: ``Config(pool=GraphPool())``.

    It holds the pool handle and the one side stream every capture into the pool runs on. Both are needed: the
    caching allocator hands a freed block only to allocations on the stream that freed it, so models that
    share a pool handle but capture on streams of their own share no memory. Created lazily, on the first
    capture (needs CUDA then, not before). Models sharing a pool must not replay at the same time (one thread,
    one stream at a time), as the sizes of one model already do not.
    """

    def __init__(self) -> None:
        self._handle: Any = None
        self._stream: Any = None

    def acquire(self) -> tuple[Any, Any]:
        """``(pool handle, capture stream)``, created on the first call."""
        if self._handle is None:
            self._handle, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        return self._handle, self._stream

    def __repr__(self) -> str:
        return f"GraphPool({'unused' if self._handle is None else self._handle})"


def pool_bytes(pool: Any) -> int:
    """Bytes the caching allocator holds in the CUDA graph pool ``pool`` (0 without CUDA or a pool)."""
    if pool is None or not torch.cuda.is_available():
        return 0
    key = tuple(pool)
    segments = torch.cuda.memory._snapshot()["segments"]
    return sum(seg["total_size"] for seg in segments if tuple(seg.get("segment_pool_id", ())) == key)


def timed_capture(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``fn`` and return its result with the wall seconds it took (device work included)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def release_compiled() -> None:
    """Free what the last dropped module held (graphs, compiled code, device memory), so the next one starts
    alike: Dynamo's caches are reset first, then a garbage collection, then torch's cached blocks go back to the
    device. In that order because a reset can leave the modules it held in reference cycles that only a
    collection frees; collected before the reset, they stayed alive (device memory included) until some later
    collection, and an allocation that needs that memory before then runs out. Drop your references first."""
    import gc

    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
