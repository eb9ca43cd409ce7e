"""Adapter: Meta's ``piecewise_cuda_graphs`` around the eager reference model, attention as ``@no_graph``.

That package captures the *eager* forward (no Dynamo, no Inductor) with ``torch.cuda.graph``, ending a graph
segment at every call of a ``@no_graph`` function, running it eagerly, and starting the next segment; replay
runs the segments in order and calls each ``@no_graph`` function again on the tensors it got at capture. So it
is the closest outside baseline for piecegraph's ``piecewise``/``breakable`` modes.

The reference decoder calls ``torch.ops.piecegraph_models.attention(q, k, v, out, layer)``; during capture we
swap that attribute for a ``@no_graph`` wrapper (and restore it after), so the model's code stays unchanged.
The op writes its result into ``out`` (the package forbids returning CUDA tensors from ``@no_graph``) and reads
the batch layout from the forward context at call time, so replays honour the current metadata (varlen too).
"""

from __future__ import annotations

import bisect
import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import torch

from piecegraph.context import forward_context

PACKAGE = "piecewise_cuda_graphs"


def available() -> str | None:
    """``None`` when the adapter can run here, else why not (for a skipped row's reason)."""
    if importlib.util.find_spec(PACKAGE) is None:
        return f"{PACKAGE} is not installed (pip install piecewise-cuda-graphs)"
    if not torch.cuda.is_available():
        return f"{PACKAGE} captures CUDA graphs: needs a GPU"
    return None


@contextlib.contextmanager
def attention_as_no_graph() -> Iterator[None]:
    """Inside the block, the reference attention op is a ``@no_graph`` function (a graph break at each call).

    Why patch the namespace attribute: ``Attention.forward`` looks the op up on ``torch.ops.piecegraph_models``
    at every call, so replacing the attribute reaches every layer without touching the model. The recorded eager
    step keeps the wrapper's inner function, which calls the real op, so replays work after the restore.
    """
    import piecewise_cuda_graphs as pcg

    namespace = torch.ops.piecegraph_models
    original = namespace.attention  # resolving it first caches the packet on the namespace

    @pcg.no_graph
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int) -> None:
        original(q, k, v, out, layer)

    namespace.attention = attention
    try:
        yield
    finally:
        namespace.attention = original


class MetaPiecewise:
    """The eager model captured per size with ``piecewise_cuda_graphs``, all sizes in one pool.

    Constraints: the model takes ``(input_ids [T], positions [T])`` and returns a tensor with ``T`` rows (the
    reference :class:`~piecegraph.models.Decoder`); calls must run inside a forward context; a call with more
    tokens than the largest captured size raises (the bench only uses captured sizes). Outputs are copies, as
    piecegraph's ``copy_outputs=True`` returns, so the timings compare like with like.
    """

    def __init__(self, model: torch.nn.Module, sizes: tuple[int, ...]):
        self.model = model
        self.sizes = tuple(sorted(set(sizes)))
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple[Any, list[torch.Tensor], torch.Tensor]] = {}
        self.capture_s: dict[int, float] = {}

    def capture(self, make_inputs: Callable[[int], tuple[tuple[Any, ...], Any]]) -> None:
        """Capture every size, largest first (smaller sizes then reuse the pool's blocks)."""
        import time

        for n in sorted(self.sizes, reverse=True):
            torch.cuda.synchronize()
            start = time.perf_counter()
            args, meta = make_inputs(n)
            self.graphs[n] = self._capture_one(tuple(a.clone() for a in args), meta)
            torch.cuda.synchronize()
            self.capture_s[n] = time.perf_counter() - start

    def _capture_one(self, static: tuple[torch.Tensor, ...], meta: Any) -> tuple[Any, list[torch.Tensor], torch.Tensor]:
        import piecewise_cuda_graphs as pcg

        with torch.no_grad(), forward_context(meta):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up off the capture stream: cuBLAS handles, allocator blocks
                self.model(*static)
            torch.cuda.current_stream().wait_stream(side)
            seq = pcg.CUDAGraphSequence(pool=self.pool)
            with attention_as_no_graph(), pcg.piecewise_graph(seq):
                out = self.model(*static)
        return seq, list(static), out

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[0]
        pos = bisect.bisect_left(self.sizes, n)
        if pos == len(self.sizes):
            raise ValueError(f"{n} tokens is above the largest captured size {self.sizes[-1]}")
        seq, static, out = self.graphs[self.sizes[pos]]
        for buf, x in zip(static, (input_ids, positions)):
            buf[:n].copy_(x)
            buf[n:].zero_()  # pad tokens (position 0): the attention op leaves rows past its metadata's n zero
        with torch.no_grad():
            seq.replay()
        return out[:n].clone()

    def stats(self) -> dict[str, Any]:
        from piecegraph.graphs.capture import pool_bytes

        # graph + eager steps; a private field of the package (0 if it is renamed: only a statistic)
        segments = [len(getattr(seq, "_segments", ())) for seq, _, _ in self.graphs.values()]
        return {
            "sizes": sorted(self.graphs),
            "pieces": max(segments, default=0),
            "capture_s": dict(sorted(self.capture_s.items())),
            "pool_bytes": pool_bytes(self.pool),
        }
