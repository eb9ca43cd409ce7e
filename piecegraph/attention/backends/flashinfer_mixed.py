"""Full CUDA graphs of prefill and mixed steps on FlashInfer: the graphs of auto's ``full-mixed`` module.

A piecewise step launches every piece and every layer's attention from the host: for a 0.5B-shaped model, a
prompt beside nine decode rows took 6.5 ms of host work against 5.0 ms on the device, and 2.7 against 3.1 as one
graph (H100, under the profiler: ``benchmarks/results/2026-12-07_h100_profile_step_timeline.json``).
FlashInfer's prefill wrapper runs in a CUDA graph when it is built with ``use_cuda_graph=True`` and fixed buffers,
and then takes any layout that fits them (FlashInfer 0.5.3, ``scheduler.cuh`` ``PrefillSplitQOKVIndptr``):

- the batch size (request slots) is fixed per wrapper: a step with fewer sequences gets pad requests of no query
  tokens and one KV token on the scratch page, which the kernels give no work;
- the token count may be anything up to the one of the wrapper's first plan (``_max_total_num_rows``, set here
  to the graph's size); the real count goes to the device through the int workspace, and pad tokens belong to
  no request (their attention output is not written; no real row reads them);
- the schedule baked into the graph (``plan_info``: ``cta_tile_q`` from ``size - seqs + 1`` query rows,
  ``padded_batch_size`` from the size and slots, split-KV always on) is a function of those two numbers only,
  so it stays fixed; each step's KV chunk size and tile lists go into the int workspace. The backend still
  checks ``plan_info`` at every plan (``_plan_graph``).

So one graph per token size serves every step of at most ``mixed_graph_seqs(size)`` sequences (``min(size,
MIXED_GRAPH_SEQS)``); larger batches, which are mostly decode rows and long on the device anyway, stay piecewise.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from piecegraph.attention.backends.flashinfer_layout import device_table, pad_rows, page_layout, scratch_padded
from piecegraph.attention.metadata import AttentionMetadata
from piecegraph.attention.types import PagedCache

MIXED_GRAPH_SEQS = 64  # request slots of a mixed graph at most: steps with more sequences run piecewise


def mixed_graph_seqs(size: int) -> int:
    """The sequences a mixed-step graph of ``size`` tokens has slots for."""
    return min(size, MIXED_GRAPH_SEQS)


class MixedGraphs:
    """The mixed-step half of :class:`~piecegraph.attention.backends.flashinfer.FlashInferBackend`: per token size
    a CUDA-graph prefill wrapper, its buffers and the last step planned on it. What it uses of the backend comes
    through ``self`` (``_graph_record``, ``_plan_graph``, ``_graph_workspace``, ...), so this module imports none
    of it."""

    captures_mixed_steps = True  # AttentionMetadata.for_cuda_graph accepts a step with prefill rows

    def mixed_graph_seqs(self, size: int) -> int:
        """How many sequences a mixed step may have to replay the graph of ``size`` tokens."""
        return mixed_graph_seqs(size)

    def _mixed_for_cuda_graph(self, meta: AttentionMetadata, size: int) -> AttentionMetadata:
        """``meta`` (a step with prefill rows) as the mixed graph of ``size`` tokens reads it: planned on that size's
        wrapper with pad requests up to its slots, positions and slots padded to ``size`` rows."""
        n, layout = meta.num_tokens, meta.layout
        graph = self._mixed.get(size) or self._new_mixed_graph(meta.cache, size)
        if n > size or layout is None or layout.num_seqs > graph.seqs:
            raise ValueError(
                f"a step of {n} tokens over {layout.num_seqs if layout else '?'} sequences does not fit the mixed "
                f"CUDA graph of {size} tokens and {graph.seqs} sequences; run it piecewise")
        if graph.last is not None and graph.last[0]() is meta:
            return graph.last[1]
        cache, padded = meta.cache, scratch_padded(layout, graph.seqs - layout.num_seqs, new=0)
        dev, cpu = page_layout(padded, cache.device, indices_only=True, table=device_table(cache))
        args = (cpu["qo_indptr"], cpu["kv_indptr"], dev["kv_indices"], cpu["kv_last_page_len"], *self._shape(cache))
        self._plan_graph(graph.plan.slot, size, args, self._options(cache, cpu, prefill=True))
        rows = size - n
        view = meta.replace(positions=pad_rows(meta.positions, rows), slot_mapping=pad_rows(meta.slot_mapping, rows),
                            kv_lens=None, page_table=None, mask=None, plan=graph.plan)
        graph.last = (weakref.ref(meta), view)
        return view

    def _new_mixed_graph(self, cache: PagedCache, size: int) -> Any:
        seqs = self.mixed_graph_seqs(size)
        zeros = {"dtype": torch.int32, "device": cache.device}
        indptr, last = torch.zeros(seqs + 1, **zeros), torch.zeros(seqs, **zeros)
        # every slot holds at least one page (a pad request its scratch page): the layout's pages, at most
        indices = torch.zeros(seqs * cache.max_pages_per_seq, **zeros)
        wrapper = self._fi.BatchPrefillWithPagedKVCacheWrapper(
            self._graph_workspace(cache, size, seqs), "NHD", use_cuda_graph=True, backend="fa2",
            qo_indptr_buf=torch.zeros(seqs + 1, **zeros), paged_kv_indptr_buf=indptr, paged_kv_indices_buf=indices,
            paged_kv_last_page_len_buf=last,
        )
        # The first plan fixes the most tokens a graph plan takes; a graph of `size` may see any count up to it.
        if hasattr(wrapper, "_max_total_num_rows"):
            wrapper._max_total_num_rows = size
        graph = self._mixed[size] = self._graph_record(wrapper, indptr, indices, last, seqs)
        return graph
