"""The ``flashinfer`` attention backend: FlashInfer's paged kernels behind the one split op (CUDA only).

``plan`` (host, once per step; lazily, at the step's first attention call, so a step replaying a full graph
skips it) turns the step's :class:`BatchLayout` into FlashInfer's CSR page layout (``qo_indptr``, ``kv_indptr``,
``kv_indices``, ``kv_last_page_len``); the device half goes in one packed copy. ``kv_indices`` is gathered on the
device from the cache's persistent page table (:meth:`KVCache.device_table`) by each row's slot, so a step sends O(rows)
ints whatever its context; ``plan()``'s host arguments (indptr, last page lengths, KV lengths) go in pinned memory,
since ``plan()`` copies them to the device and a copy from pageable memory waits for the stream, and the lengths it
takes a ``max()`` of as :class:`~piecegraph.attention.backends.flashinfer_layout.HostInts` (``flashinfer_layout.py``
says why). A pure decode step plans a
``BatchDecodeWithPagedKVCacheWrapper`` (on tensor cores for more than 4 query heads per KV head, the plain decode
kernel otherwise: ``FlashInferBackend.decode_tensor_cores``); anything else (prefill, mixed, chunked-prefill
continuation) a causal ``BatchPrefillWithPagedKVCacheWrapper`` (FlashInfer aligns the causal mask bottom-right,
which is where a step's new tokens sit). ``forward`` writes the new keys and values with one ``index_copy_``
each (in a full CUDA graph: one kernel for both, ``kv_write.py``) at the step's flat slots
(``meta.slot_mapping``: the page and offset ``append_paged_kv_cache`` would derive from the CSR layout; ~5 us of
host per copy against its wrapper's ~26 us, in every layer of an eager step), then ``wrapper.run``.
``for_cuda_graph`` pads a decode step to ``size`` rows on a per-size CUDA-graph decode wrapper.

Measured in this project (FlashInfer 0.5.3, H200, 14 q / 2 kv heads, head_dim 64): ragged prefill ``run()``
18-23 us of CPU; paged decode of 7 query heads per KV head needs ``use_tensor_cores=True`` (the plain decode
kernel refuses group size 7) and its ``run()`` costs 20-25 us of CPU; ``plan()`` 65-690 us per step; the first
JIT build 17-51 s.

Verified in the 0.5.3 source (decode.py, prefill.py, page.py, csrc/batch_prefill.cu, attention/scheduler.cuh):

- The tensor-core decode wrapper plans and runs the ``fa2`` batch-prefill module (``get_batch_prefill_module``,
  ``functools.cache``d); the prefill wrapper is pinned to ``backend="fa2"`` (``auto`` picks fa3 on sm90) so
  both share one JIT build and the prefill wrapper skips fa3's 64 MiB vector-sparse buffers. The plain decode
  wrapper runs a JIT module of its own (``get_batch_decode_module``): one more build for such models.
- With ``use_cuda_graph=True``, on either kernel, ``plan()`` copies indptr / last_page_len / indices into the
  buffers given to the constructor, ``qo_indptr`` is an ``arange`` made once in ``__init__``, and the int
  workspace is allocated once in ``__init__``. ``run()`` reads exactly: both workspaces, those four buffers,
  q, the caches, out, the host ``plan_info`` and host scalars (scale, window, heads; ``max_kv_len`` only on
  trtllm-gen). So every device pointer a captured ``run`` bakes is fixed.
- The host ``plan_info`` is baked into the graph too. In CUDA-graph mode ``PrefillPlan`` forces ``split_kv``,
  sizes the grid by ``padded_batch_size = max(2 * SMs / kv_heads, ceil(B * group / cta_tile_q) + B - 1)`` with
  ``cta_tile_q`` from the group size, and takes every workspace offset from those: all fixed per batch size.
  The per-step ``kv_chunk_size`` and ``total_num_rows`` live in the int workspace, read by the kernels through
  pointers. :meth:`FlashInferBackend._plan_graph` still checks that ``plan_info`` never changes for a size.
  The split-KV partial outputs take ``heads x padded_batch_size x cta_tile_q x (head_dim + 1)`` floats of the
  float workspace: a size that needs more than it holds gets a larger one (:func:`graph_workspace_bytes`).
  The plain decode kernel's graph plan also fixes its grid per size (``plan_info`` checked alike); on an H100 at
  1 and 10 rows (32 / 8 heads of 64) its split-KV buffers took 1.2 MB of the float workspace.
- ``append_paged_kv_cache(k, v, batch_indices, positions, (k_cache, v_cache), kv_indices, kv_indptr,
  kv_last_page_len, kv_layout)`` writes token i at page ``kv_indices[kv_indptr[b] + pos // page_size]``, slot
  ``pos % page_size`` (``b, pos = batch_indices[i], positions[i]``): the slot ``slot_mapping`` already holds
  (``page * page_size + pos % page_size``, pad rows on the scratch page), so a plain ``index_copy_`` does it.
- ``plan()`` reads ``qo_indptr``, ``kv_indptr``, ``last_page_len`` on the host (``.to("cpu")``: a sync if they
  were on the GPU), so those go in as CPU tensors; ``kv_indices`` is only moved or copied device-side, so it
  goes in already on the device (a CPU one would be a blocking copy in CUDA-graph mode).
- ``plan()`` writes its schedule into one pinned host buffer per wrapper and ``cudaMemcpyAsync``-s it, without
  a sync; re-planning a wrapper before that copy ran would corrupt it, so :meth:`_plan_on` waits for the
  previous plan's copy (only when the host is a whole step ahead of the GPU).
- ``run()`` reads a cached ALiBi slopes tensor made on first use by a blocking copy, which capture forbids;
  ``__init__`` makes it up front.

Constraints: bf16/fp16 caches (FlashInfer has no fp32 kernels); q must have the cache's dtype. A wrapper holds one
plan at a time, so ``forward`` re-plans (counted in ``replans``) when metadata planned earlier runs after a later
step's. Full CUDA graphs: one decode wrapper, an 8 MiB int workspace and an 8 MiB pinned buffer per capture size;
``for_cuda_graph`` plans before every capture and replay (never during), and pad rows write and read the
scratch page only.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from piecegraph.attention.backends.flashinfer_layout import (
    device_table,
    graph_workspace_bytes,
    pad_rows,
    page_layout,
    scratch_padded,
)
from piecegraph.attention.backends.flashinfer_mixed import MixedGraphs
from piecegraph.attention.backends.kv_write import KVWriter, write_kv
from piecegraph.attention.metadata import AttentionMetadata, BatchLayout
from piecegraph.attention.types import CacheShape, PagedCache, v_head_dim

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace; shared by every wrapper


class _Slot:
    """One FlashInfer wrapper, the plan it holds now, and an event recorded after its last ``plan()``."""

    def __init__(self, wrapper: Any) -> None:
        self.wrapper = wrapper
        self.holds: FlashInferPlan | None = None
        self.planned: torch.cuda.Event | None = None
        self.plan_info: tuple[int, ...] | None = None  # graph wrappers: the schedule their graphs baked in


@dataclass(eq=False)  # identity: "is this the plan the wrapper holds?"
class FlashInferPlan:
    """What ``forward`` needs: the wrapper's slot, the device page layout the cache write reads, and the
    ``plan()`` arguments to re-plan with (none for a graph plan, whose wrapper ``for_cuda_graph`` re-plans).

    An eager plan is lazy: ``layout`` is kept and the page layout and ``plan()`` happen at the step's first
    attention call (``kv_indptr`` is None until then), so a step that replays a full graph (whose metadata
    ``for_cuda_graph`` builds anew) never pays for the eager wrapper's plan."""

    slot: _Slot
    kv_indptr: torch.Tensor | None = None
    kv_indices: torch.Tensor | None = None
    kv_last_page_len: torch.Tensor | None = None
    args: tuple = ()
    kwargs: dict | None = None
    graph: bool = False
    layout: BatchLayout | None = None


@dataclass(eq=False)
class _Graph:
    """A capture size: its fixed plan (graph wrapper + buffers) and the last step planned on it."""

    plan: FlashInferPlan
    last: tuple[weakref.ref, AttentionMetadata] | None = None
    seqs: int = 0  # a mixed-step graph's request slots (flashinfer_mixed.py)


class FlashInferBackend(MixedGraphs):
    """FlashInfer paged attention; see the module docstring. Constructing it imports flashinfer."""

    name = "flashinfer"
    kernel = "FlashInfer BatchPrefillWithPagedKVCacheWrapper / BatchDecodeWithPagedKVCacheWrapper"

    def __init__(self, config: CacheShape, device: torch.device | str) -> None:
        import flashinfer

        self._fi = flashinfer
        self.num_heads = config.num_heads
        self.scale = config.head_dim ** -0.5
        # Values of another width than keys (head_dim_vo != head_dim_qk): FlashInfer 0.5.3's decode wrapper plans
        # one head_dim for both (decode.py plan(head_dim=...)), its prefill wrapper takes head_dim_vo. So such a
        # model's decode steps run on a prefill wrapper too: a decode row is a query of length 1, and the
        # tensor-core decode wrapper runs the same fa2 prefill kernels anyway.
        self.v_head_dim = v_head_dim(config)
        self._split_dims = self.v_head_dim != config.head_dim
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._cuda = self.workspace.is_cuda  # False only under a CPU stand-in for flashinfer (tests)
        self._prefill = _Slot(flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2"))
        # Decode on tensor cores only for query groups of more than 4 heads per KV head (vLLM's and SGLang's rule
        # too): the plain decode kernel takes groups of 1-4 (and 8, but not 7) and, measured on an H100 at 1 and
        # 10 rows (32 / 8 heads of 64, context 256, CUDA graphs), ran 16 layers in 123 / 169 us against the
        # tensor-core kernel's 153 / 193 us, which splits every row's keys and merges the parts.
        self.decode_tensor_cores = config.num_heads // config.num_kv_heads > 4
        self._decode = (_Slot(flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2"))
                        if self._split_dims else
                        _Slot(flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                            self.workspace, "NHD", use_tensor_cores=self.decode_tensor_cores)))
        self._graphs: dict[int, _Graph] = {}
        self._mixed: dict[int, _Graph] = {}  # mixed-step graphs by token size (flashinfer_mixed.py)
        self._write_kv = KVWriter()
        self.replans = 0
        self.plans, self.plan_s = 0, 0.0  # wrapper plan() calls and their host seconds (the engine reports both)
        try:  # private helper, so best effort: without it the first run() must not be a capture
            from flashinfer.utils import _get_cache_alibi_slopes_buf

            _get_cache_alibi_slopes_buf(config.num_heads, self.workspace.device)
        except (ImportError, AttributeError, TypeError):
            pass

    # -- planning (host, once per step) -----------------------------------------------------------------
    reads_page_table = False  # it reads its own CSR page layout: AttentionMetadata skips the dense table

    def plan(self, meta: AttentionMetadata) -> None:
        """Lazy: records the step's layout; :meth:`_plan_now` runs at its first attention call."""
        slot = self._decode if meta.is_decode else self._prefill
        meta.plan = FlashInferPlan(slot, layout=_layout(meta))

    def _plan_now(self, meta: AttentionMetadata, plan: FlashInferPlan) -> None:
        """The page layout (device half in one copy) and the wrapper's ``plan()`` of an eager step."""
        if self._capturing():
            raise RuntimeError("flashinfer attention: a step's first attention call is being captured, but "
                               "FlashInfer plans on the host first; run the step once before capturing it")
        cache, decode = meta.cache, meta.is_decode
        dev, cpu = page_layout(plan.layout, cache.device, table=device_table(cache))
        head = () if decode and not self._split_dims else (cpu["qo_indptr"],)
        plan.args = (*head, cpu["kv_indptr"], dev["kv_indices"], cpu["kv_last_page_len"], *self._shape(cache))
        plan.kwargs = self._options(cache, cpu, prefill=not decode or self._split_dims)
        plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len = (
            dev["kv_indptr"], dev["kv_indices"], dev["kv_last_page_len"])
        self._plan_on(plan.slot, plan.args, plan.kwargs)
        plan.slot.holds = plan

    def _shape(self, cache: PagedCache) -> tuple[int, int, int, int]:
        return self.num_heads, cache.num_kv_heads, cache.head_dim, cache.page_size

    def _options(self, cache: PagedCache, cpu: dict[str, torch.Tensor], prefill: bool = False) -> dict[str, Any]:
        # seq_lens: the KV lengths, which plan() would otherwise compute into a pageable tensor, copy from it and
        # take the max of element by element (see flashinfer_layout.py)
        options = {"q_data_type": cache.dtype, "kv_data_type": cache.dtype, "sm_scale": self.scale,
                   "seq_lens": cpu["seq_lens"]}
        if prefill:  # a prefill wrapper's plan: causal (bottom-right aligned), its own value width
            options.update(causal=True, head_dim_vo=self.v_head_dim)
        return options

    def _plan_on(self, slot: _Slot, args: tuple, kwargs: dict) -> None:
        # plan() rewrites the wrapper's pinned host buffer and copies it to the GPU asynchronously: if the copy of
        # the previous plan has not run yet (host a step ahead), overwriting it would corrupt that step.
        start = time.perf_counter()
        if slot.planned is not None and not slot.planned.query():
            slot.planned.synchronize()
        slot.wrapper.plan(*args, **kwargs)
        self.plans += 1
        self.plan_s += time.perf_counter() - start
        if self._cuda:
            if slot.planned is None:
                slot.planned = torch.cuda.Event()
            slot.planned.record()

    def _capturing(self) -> bool:
        return self._cuda and torch.cuda.is_current_stream_capturing()

    def _replan(self, plan: FlashInferPlan) -> None:
        if self._capturing():
            raise RuntimeError(
                "flashinfer attention: this step's plan was replaced by a later step's (metadata built ahead) "
                "and FlashInfer cannot re-plan during CUDA graph capture. Build each step's metadata right "
                "before running it."
            )
        self._plan_on(plan.slot, plan.args, plan.kwargs)
        plan.slot.holds = plan
        self.replans += 1

    # -- CUDA graphs (mode="full", pure decode steps) ---------------------------------------------------
    def _graph_step(self, meta: AttentionMetadata, size: int) -> tuple[Any, tuple[dict, dict] | None]:
        """The graph slot of ``size`` and ``meta``'s decode layout padded to ``size`` rows, as ``page_layout``'s
        ``(dev, cpu)`` tables; ``None`` for the tables when the slot holds this step already (capture, then
        replay). Pad rows: one scratch page each, written at position 0 by their own batch row, never a real page."""
        n = meta.num_tokens
        if n > size:
            raise ValueError(f"a decode step of {n} sequences does not fit a CUDA graph of size {size}")
        graph = self._graphs.get(size) or self._new_graph(meta.cache, size)
        if graph.last is not None and graph.last[0]() is meta:
            return graph, None
        cache, padded = meta.cache, scratch_padded(_layout(meta), size - n, new=1)
        return graph, page_layout(padded, cache.device, indices_only=True, table=device_table(cache))

    def for_cuda_graph(self, meta: AttentionMetadata, size: int) -> AttentionMetadata:
        if not meta.is_decode:
            return self._mixed_for_cuda_graph(meta, size)
        graph, tables = self._graph_step(meta, size)
        if tables is None:
            return graph.last[1]
        (dev, cpu), cache, pad = tables, meta.cache, size - meta.num_tokens
        head = (cpu["qo_indptr"],) if self._split_dims else ()
        args = (*head, cpu["kv_indptr"], dev["kv_indices"], cpu["kv_last_page_len"], *self._shape(cache))
        self._plan_graph(graph.plan.slot, size, args, self._options(cache, cpu, prefill=self._split_dims))
        view = meta.replace(
            positions=pad_rows(meta.positions, pad), slot_mapping=pad_rows(meta.slot_mapping, pad),
            kv_lens=pad_rows(meta.kv_lens, pad), mask=None, plan=graph.plan,
        )
        graph.last = (weakref.ref(meta), view)
        return view

    def _graph_workspace(self, cache: PagedCache, size: int, seqs: int | None = None) -> torch.Tensor:
        """The float workspace for a graph of ``size`` tokens over ``seqs`` sequences (default ``size``: decode):
        the shared one, or, when this graph needs more, a larger one that later wrappers share (graphs captured
        before keep theirs, whose address they baked in)."""
        if self._cuda:
            num_sm = torch.cuda.get_device_properties(self.workspace.device).multi_processor_count
            need = graph_workspace_bytes(self.num_heads, cache.num_kv_heads, self.v_head_dim, size, num_sm, seqs)
            if need > self.workspace.numel():
                self.workspace = torch.zeros(-(-need // (16 << 20)) * (16 << 20), dtype=torch.uint8,
                                             device=self.workspace.device)
        return self.workspace

    @staticmethod
    def _graph_record(wrapper: Any, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor,
                      seqs: int = 0) -> _Graph:
        """A graph size's record: its wrapper's fixed buffers (as a graph plan) and its sequence slots."""
        return _Graph(FlashInferPlan(_Slot(wrapper), indptr, indices, last, graph=True), seqs=seqs)

    def _new_graph(self, cache: PagedCache, size: int) -> _Graph:
        # Buffers whose addresses the graphs bake in: plan() refills them before every replay of this size.
        zeros = {"dtype": torch.int32, "device": cache.device}
        indptr, last = torch.zeros(size + 1, **zeros), torch.zeros(size, **zeros)
        indices = torch.zeros(size * cache.max_pages_per_seq, **zeros)  # every row holds 1..max_pages_per_seq
        if self._split_dims:  # a prefill wrapper of queries of length 1 (see __init__); qo_indptr: 0..size
            wrapper = self._fi.BatchPrefillWithPagedKVCacheWrapper(
                self._graph_workspace(cache, size), "NHD", use_cuda_graph=True, backend="fa2",
                qo_indptr_buf=torch.arange(size + 1, **zeros), paged_kv_indptr_buf=indptr,
                paged_kv_indices_buf=indices, paged_kv_last_page_len_buf=last,
            )
        else:
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._graph_workspace(cache, size), "NHD", use_cuda_graph=True,
                use_tensor_cores=self.decode_tensor_cores,
                paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last,
            )
        graph = self._graphs[size] = self._graph_record(wrapper, indptr, indices, last)
        return graph

    def _plan_graph(self, slot: _Slot, size: int, args: tuple, kwargs: dict) -> None:
        if self._capturing():
            raise RuntimeError("flashinfer attention: for_cuda_graph must run before a capture, not during one")
        self._plan_on(slot, args, kwargs)
        info = _plan_info(slot.wrapper)
        if slot.plan_info is None:
            slot.plan_info = info
        elif info != slot.plan_info:
            raise RuntimeError(
                f"flashinfer attention: the schedule (plan_info) of CUDA graph size {size} changed "
                f"({slot.plan_info} -> {info}); graphs captured with the old one would replay it. This "
                f"FlashInfer ({getattr(self._fi, '__version__', '?')}) plans CUDA graphs differently from 0.5.3: "
                "use mode='piecewise' for such steps."
            )

    # -- the op (inside the split op, per layer) --------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int,
                meta: AttentionMetadata, *, scale: float | None = None, window: int | None = None,
                softcap: float | None = None, sinks: torch.Tensor | None = None,
                alibi_slopes: torch.Tensor | None = None) -> None:
        cache, plan = meta.cache, meta.plan
        if alibi_slopes is not None:
            raise ValueError(f"flashinfer attention: layer {layer} takes alibi_slopes (ALiBi position biases), which "
                             "piecegraph's FlashInfer backend does not pass to FlashInfer's kernels; use "
                             "attention_backend='torch'")
        if sinks is not None:
            raise ValueError(f"flashinfer attention: layer {layer} takes attention sinks (learned per-head softmax "
                             "logits), which piecegraph's FlashInfer backend does not pass to FlashInfer's kernels; "
                             "use attention_backend='torch'")
        if window is not None or softcap is not None or (scale is not None and scale != self.scale):
            raise ValueError(
                f"flashinfer attention plans one softmax scale ({self.scale}) for every layer and no sliding window "
                f"or logit softcap; layer {layer} asks for scale={scale}, window={window}, softcap={softcap}. "
                "Use attention_backend='torch' (or a KV cache whose max_seq_len is <= the window)."
            )
        if q.dtype != cache.dtype:
            raise ValueError(f"flashinfer attention: q is {q.dtype} but the KV cache is {cache.dtype}; FlashInfer "
                             f"plans one dtype for both: build the cache with dtype={q.dtype}")
        if not isinstance(plan, FlashInferPlan):
            raise TypeError("flashinfer attention: the metadata was not planned by a flashinfer backend (built "
                             "for another cache?); build it with AttentionMetadata.for_batch on this cache")
        if not plan.graph and plan.kv_indptr is None:
            self._plan_now(meta, plan)
        elif not plan.graph and plan.slot.holds is not plan:
            self._replan(plan)
        kc, vc = cache.k[layer], cache.v[layer]
        heads_kv, dim = cache.num_kv_heads, cache.head_dim
        k_slots, v_slots = kc.view(-1, heads_kv, dim), vc.view(-1, heads_kv, vc.shape[-1])
        if plan.graph:  # captured, so the kernel's launch costs no host time: one launch for both (kv_write.py)
            self._write_kv(k, v, k_slots, v_slots, meta.slot_mapping)
        else:  # eager: two index_copy_ cost less host time than a Triton launch
            write_kv(k, v, k_slots, v_slots, meta.slot_mapping, fused=False)
        target = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
        plan.slot.wrapper.run(q.contiguous(), (kc, vc), out=target)
        if target is not out:
            out.copy_(target)


def _layout(meta: AttentionMetadata) -> BatchLayout:
    if meta.layout is None:
        raise ValueError("flashinfer attention needs the step's BatchLayout (meta.layout): build the metadata "
                         "with AttentionMetadata.for_batch / for_decode / dummy")
    return meta.layout


def _plan_info(wrapper: Any) -> tuple[int, ...] | None:
    info = getattr(wrapper, "_plan_info", None)  # private; None (no check) if a release drops or renames it
    try:
        return tuple(int(x) for x in info)
    except (TypeError, ValueError):
        return None
