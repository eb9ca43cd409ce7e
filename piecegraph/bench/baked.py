"""The ``baked-graph`` bench mode: each case's whole step captured as one CUDA graph, its layout baked in.

The lower bound for piecewise graphs on a layout: the compiled model (Inductor, ``torch.compile``'s default
mode) with its attention op recorded inside one ``torch.cuda.graph`` per case, the attention backend's plan
and the metadata tensors of that step fixed. Replays are right only while that exact step repeats and nothing
re-plans the backend (which the bench guarantees, one case after another): a server cannot use it, which is
why piecewise exists. Written with ``torch.cuda.graph`` directly so it works for any attention backend
(CUDA graph trees, ``reduce-overhead``, refuse FlashInfer's op: it keeps allocations of its own in the pool).
"""

from __future__ import annotations

from typing import Any

import torch

from piecegraph.context import current_forward_context

NOTE = ("the step's layout, metadata and backend plan are baked into one graph per case: the lower bound for "
        "piecewise, right only while that step repeats (a server would get wrong results)")


class BakedGraph:
    """``fn(input_ids, positions)`` captured once per (forward-context object, token count), then replayed.

    Inputs are copied into the graph's static buffers on every call; the output is the graph's own tensor (valid
    until the next call of that case). Needs CUDA.
    """

    def __init__(self, model: torch.nn.Module, warmup: int = 2) -> None:
        self.fn = torch.compile(model)
        self.warmup = warmup
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, Any]] = {}
        self._alive: list[Any] = []  # the metadata objects keyed by id(): kept alive so ids are not reused

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        meta = current_forward_context()
        key = (id(meta), input_ids.shape[0])
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(input_ids, positions)
            self._alive.append(meta)
        graph, ids, pos, out = entry
        ids.copy_(input_ids)
        pos.copy_(positions)
        graph.replay()
        return out

    def _capture(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple:
        ids, pos = input_ids.clone(), positions.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and warm up off the capture, as torch.cuda.graph requires
            for _ in range(self.warmup):
                self.fn(ids, pos)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.fn(ids, pos)
        return graph, ids, pos, out

    def stats(self) -> dict[str, Any]:
        return {"sizes": sorted({n for _, n in self.graphs}), "graphs": len(self.graphs)}
