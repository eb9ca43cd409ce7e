"""The ``flashinfer`` multi-head latent attention backend: FlashInfer's ``BatchMLAPagedAttentionWrapper`` (CUDA).

Read from FlashInfer 0.5.3's ``flashinfer/mla.py`` and ``include/flashinfer/attention/scheduler.cuh`` (MLAPlan):

- ``plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal,
  sm_scale, q_data_type, kv_data_type)``: all four index tensors int32; ``qo_indptr``, ``kv_indptr`` and
  ``kv_len_arr`` are read on the host (``.to("cpu")``), so they go in as (pinned) CPU tensors; ``kv_indices`` is
  moved or copied device-side, so it goes in on the device. The C++ plan never sees ``sm_scale``: ``run()`` passes
  the scale stored by the last ``plan()`` to the kernel as a host scalar.
- ``run(q_nope, q_pe, ckv_cache, kpe_cache, out=)``: ``q_nope`` ``[n, H, 512]``, ``q_pe`` ``[n, H, 64]``, caches
  ``[num_pages, page_size, dim]`` (only their page and token strides are read, so ``cache.k[layer]``'s
  ``[pages, page_size, 1, R]`` goes in viewed without its head axis), ``out`` like ``q_nope``.
  ``causal=True`` aligns the mask bottom-right (query i of a row sees keys ``< kv_len - qo_len + i + 1``),
  where a step's new tokens sit, as the paged prefill wrapper does.
- With ``use_cuda_graph=True`` the constructor's ``qo_indptr``/``kv_indptr``/``kv_indices``/``kv_len_arr``
  buffers are refilled by ``plan()``; ``run()`` reads the int workspace (made once in ``__init__``) and
  ``kv_indices``, and the host ``plan_info``, whose grid (``num_blks_x``: 2 when the average ``qo_len x heads``
  exceeds 64) and workspace offsets (sized by ``max_total_num_works`` and the SM count) are fixed for a batch of
  one token per row: the base backend's ``_plan_graph`` still checks that it never changes for a size.
- The plan's work list holds at most 16384 items (``max_total_num_works``, unchecked there): a step whose
  ``sum(ceil(qo_len x heads / tile)) + SMs`` could exceed it runs on the torch path instead (said once).
- Kernels are instantiated for ``head_dim_ckv`` 512 / ``head_dim_kpe`` 64 (DeepSeek-V2/V3, Kimi-K2, GLM-5) and
  16-bit dtypes; :func:`~piecegraph.attention.backends.flashinfer_mla_available` sends others to the torch backend.

DSA (``topk > 0``) has no sparse kernel here. A step run eagerly (eager and piecewise modes: the attention op runs
between the pieces) whose sequences hold at most ``topk`` keys each runs FlashInfer's dense kernel, which equals DSA
there (every causal key is chosen), and so does every step, full graphs included, of a cache whose ``max_seq_len``
is at most ``topk``; other steps run the torch gather path
(:class:`~piecegraph.attention.backends.torch_mla.TorchMLABackend`, whose per-step plan this backend also makes
when the cache has an indexer), said once. A full CUDA graph of a longer cache takes the torch path, so one
captured at one context length replays correctly at another.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from piecegraph.attention.backends.flashinfer import (
    WORKSPACE_BYTES,
    FlashInferBackend,
    FlashInferPlan,
    _Graph,
    _layout,
    _Slot,
)
from piecegraph.attention.backends.flashinfer_layout import device_table, pad_rows, page_layout
from piecegraph.attention.backends.torch_mla import Indexer, TorchMLABackend, write_latents
from piecegraph.attention.metadata import AttentionMetadata, BatchLayout
from piecegraph.attention.types import CacheShape, PagedCache, index_head_dim, v_head_dim

MAX_WORKS = 16384  # FlashInfer 0.5.3's MLAPlan work-list capacity (max_total_num_works)


@dataclass(eq=False)
class MLAPlan(FlashInferPlan):
    """A FlashInfer MLA plan (``args``: the four index tensors; ``scale``: the ``sm_scale`` planned) and the
    torch path's dense groups of a non-decode step (made at plan time when the cache has a DSA indexer, or
    on demand when the step is too large for one FlashInfer plan)."""

    scale: float | None = None
    groups: tuple | None = None
    size: int = 0  # a graph plan's size
    too_large: bool = False


class FlashInferMLABackend(FlashInferBackend):
    """FlashInfer MLA for dense layers, the torch path for DSA layers; see the module docstring."""

    captures_mixed_steps = False  # its graphs are decode graphs only (a step with prefill rows runs piecewise)

    name = "flashinfer"
    kernel = ("FlashInfer BatchMLAPagedAttentionWrapper; DSA layers past index_topk keys, and in full graphs of a "
              "cache whose max_seq_len exceeds index_topk: torch gather path")

    def __init__(self, config: CacheShape, device: torch.device | str) -> None:  # the base's wrappers: not made
        import flashinfer
        import flashinfer.mla

        self._fi = flashinfer
        self.num_heads = config.num_heads
        self.rank, self.rope = config.head_dim, v_head_dim(config)
        self.scale: float | None = None  # the model's, learned from the op (sm_scale is planned, the op passes it)
        self.index_head_dim = index_head_dim(config)
        self.reads_page_table = bool(self.index_head_dim)  # the torch path of DSA decode steps reads it
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._cuda = self.workspace.is_cuda
        self._eager = _Slot(flashinfer.mla.BatchMLAPagedAttentionWrapper(self.workspace))
        self._decode = self._prefill = self._eager  # one wrapper plans every eager step
        self._graphs: dict[int, _Graph] = {}
        self.replans, self.plans, self.plan_s = 0, 0, 0.0
        self._torch = TorchMLABackend(config)
        self._num_sm = (torch.cuda.get_device_properties(self.workspace.device).multi_processor_count
                        if self._cuda else 132)
        self._noted: set[str] = set()

    # -- planning (host, once per step) -----------------------------------------------------------------
    def plan(self, meta: AttentionMetadata) -> None:
        """Lazy for FlashInfer (``plan()`` runs at the step's first dense MLA call, which knows the scale); the
        torch path's decode mask or groups now when the cache has a DSA indexer."""
        groups = None
        if self.index_head_dim:
            self._torch.plan(meta)  # decode: meta.mask (token-aligned); else meta.plan = its groups
            groups = None if meta.is_decode else meta.plan
        layout = _layout(meta)
        meta.plan = MLAPlan(self._eager, layout=layout, groups=groups, too_large=self._too_large(layout))

    def _too_large(self, layout: BatchLayout) -> bool:
        """Whether FlashInfer's MLA work list could overflow for this step (never for a decode step of fewer
        than ~16k rows): its bound ``sum(ceil(qo_len * H / tile)) + SMs``."""
        heads, rows, tokens = self.num_heads, layout.num_seqs, layout.num_tokens
        if tokens * heads // 64 + rows + self._num_sm <= MAX_WORKS:
            return False
        tile = 128 if tokens * heads // rows > 64 else 64
        return sum(-(-new * heads // tile) for new in layout.num_new) + self._num_sm > MAX_WORKS

    def _args(self, plan: MLAPlan, scale: float, cache: PagedCache) -> tuple:
        return (*plan.args, self.num_heads, self.rank, self.rope, cache.page_size, True, scale, cache.dtype,
                cache.dtype)

    def _ready(self, meta: AttentionMetadata, plan: MLAPlan, scale: float) -> None:
        """Make the wrapper hold ``plan`` planned with ``scale`` (plan, re-plan or nothing)."""
        cache = meta.cache
        if plan.graph:
            if plan.scale != scale:  # a graph planned before this model's scale was known: re-plan it
                if self._capturing():
                    raise RuntimeError("flashinfer MLA: a CUDA graph is being captured with a plan made for softmax "
                                       f"scale {plan.scale}, but the model passes {scale}; run one eager step first")
                self._plan_graph(plan.slot, plan.size, self._args(plan, scale, cache), {})
                plan.scale = scale
            self.scale = scale
            return
        if plan.args and plan.slot.holds is plan and plan.scale == scale:
            return
        if self._capturing():
            raise RuntimeError("flashinfer MLA: a step's first attention call is being captured, but FlashInfer plans "
                               "on the host first (or re-plans: metadata built ahead, or a second softmax scale); "
                               "run the step once before capturing it")
        if not plan.args:
            dev, cpu = page_layout(plan.layout, cache.device, indices_only=True, table=device_table(cache))
            plan.args = (_plain(cpu["qo_indptr"]), cpu["kv_indptr"], dev["kv_indices"], _plain(cpu["seq_lens"]))
        elif plan.slot.holds is not plan:
            self.replans += 1
        self._plan_on(plan.slot, self._args(plan, scale, cache), {})
        plan.slot.holds, plan.scale, self.scale = plan, scale, scale

    # -- CUDA graphs (mode="full", pure decode steps) ---------------------------------------------------
    def for_cuda_graph(self, meta: AttentionMetadata, size: int) -> AttentionMetadata:
        graph, tables = self._graph_step(meta, size)
        if tables is None:
            return graph.last[1]
        (dev, cpu), cache, pad = tables, meta.cache, size - meta.num_tokens
        plan = graph.plan
        plan.args = (_plain(cpu["qo_indptr"]), cpu["kv_indptr"], dev["kv_indices"], _plain(cpu["seq_lens"]))
        scale = self.scale or plan.scale or (self.rank + self.rope) ** -0.5  # re-planned if the op's differs
        self._plan_graph(plan.slot, size, self._args(plan, scale, cache), {})
        plan.scale = scale
        view = meta.replace(
            positions=pad_rows(meta.positions, pad), slot_mapping=pad_rows(meta.slot_mapping, pad),
            kv_lens=pad_rows(meta.kv_lens, pad), plan=plan,
            mask=None if meta.mask is None else pad_rows(meta.mask, pad),  # DSA's torch path: zero rows attend
            page_table=None if meta.page_table is None else pad_rows(meta.page_table, pad),  # the scratch page
        )
        graph.last = (weakref.ref(meta), view)
        return view

    def _new_graph(self, cache: PagedCache, size: int) -> _Graph:
        # Buffers whose addresses the graphs bake in: plan() refills them before every replay of this size.
        zeros = {"dtype": torch.int32, "device": cache.device}
        wrapper = self._fi.mla.BatchMLAPagedAttentionWrapper(
            self.workspace, use_cuda_graph=True, qo_indptr=torch.zeros(size + 1, **zeros),
            kv_indptr=torch.zeros(size + 1, **zeros), kv_indices=torch.zeros(size * cache.max_pages_per_seq, **zeros),
            kv_len_arr=torch.zeros(size, **zeros),
        )
        graph = self._graphs[size] = _Graph(MLAPlan(_Slot(wrapper), graph=True, size=size))
        return graph

    # -- the ops (inside the split op, per layer) -------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int,
                meta: AttentionMetadata, **constants: Any) -> None:
        self._torch.forward(q, k, v, out, layer, meta)  # refuses: an MLA cache

    def mla_forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                    out: torch.Tensor, layer: int, meta: AttentionMetadata, *, scale: float, topk: int = 0,
                    indexer: Indexer | None = None, index_k: torch.Tensor | None = None) -> None:
        """As :meth:`TorchMLABackend.mla_forward`: FlashInfer's kernel for dense layers, torch for DSA."""
        cache, plan = meta.cache, meta.plan
        if not isinstance(plan, MLAPlan):
            raise TypeError("flashinfer MLA: the metadata was not planned by a flashinfer MLA backend (built for "
                            "another cache?); build it with AttentionMetadata.for_batch on this cache")
        if q_nope.dtype != cache.dtype or q_pe.dtype != cache.dtype:
            raise ValueError(f"flashinfer MLA: q_nope/q_pe are {q_nope.dtype}/{q_pe.dtype} but the KV cache is "
                             f"{cache.dtype}; build the cache with dtype={q_nope.dtype}")
        write_latents(cache, layer, meta.slot_mapping, ckv, kpe, index_k)
        if (topk > 0 and not self._dense_equivalent(cache, plan, topk)) or plan.too_large:
            self._note("DSA layers (topk > 0) run on the torch gather path: FlashInfer has no sparse MLA kernel "
                       "here" if topk > 0 else
                       "a step too large for one FlashInfer MLA plan (its 16384-item work list) runs on the torch path")
            groups = () if meta.is_decode else self._groups(meta, plan)
            self._torch.attend(q_nope, q_pe, out, layer, meta, groups, scale=scale, topk=topk, indexer=indexer)
            return
        self._ready(meta, plan, scale)
        pages, ps = cache.k[layer].shape[:2]
        target = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
        plan.slot.wrapper.run(q_nope.contiguous(), q_pe.contiguous(), cache.k[layer].view(pages, ps, self.rank),
                              cache.v[layer].view(pages, ps, self.rope), out=target)
        if target is not out:
            out.copy_(target)

    def _dense_equivalent(self, cache: PagedCache, plan: MLAPlan, topk: int) -> bool:
        """Whether a DSA layer may run FlashInfer's dense kernel this step, where DSA chooses every causal key:
        always when no sequence of the cache can hold more than ``topk`` keys (``max_seq_len``: full graphs
        too); else when no sequence of this step does and the step runs eagerly (a piecewise step's attention
        does; a full graph keeps the torch path, which replays right at any length)."""
        if cache.max_seq_len <= topk:
            return True
        return not plan.graph and not self._capturing() and max(plan.layout.kv_lens, default=0) <= topk

    def _groups(self, meta: AttentionMetadata, plan: MLAPlan) -> tuple:
        """The torch path's groups of a non-decode step (planned now if the step's plan has none)."""
        if plan.groups is None:
            scratch = meta.replace(plan=None)
            self._torch.plan(scratch)
            plan.groups = scratch.plan
        return plan.groups

    def _note(self, message: str) -> None:
        if message not in self._noted:
            self._noted.add(message)
            warnings.warn(f"flashinfer MLA: {message}", stacklevel=4)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor view of a :class:`~piecegraph.attention.backends.flashinfer_layout.HostInts` (the MLA plan
    hands these straight to C++ and never takes their max in Python)."""
    return t.as_subclass(torch.Tensor)
