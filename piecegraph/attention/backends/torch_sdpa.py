"""The ``torch`` attention backend: paged KV cache, vectorized over sequences, one SDPA call per group.

No Python loop over sequences inside the op: the step's layout is padded once, on the host, into at most two
groups (decode rows; rows with several new tokens), each a dense ``[batch, max_new, ...]`` problem whose keys are
gathered from the pages in one index and whose causal mask is built at plan time, for all layers. So the op
issues the same bounded number of kernels whatever the number of sequences.

GQA is folded into SDPA's query-length dimension (``[B, Hkv, G * Q, D]`` against ``[B, Hkv, L, D]``): every kv
head serves G query heads, so this is exact, and it avoids ``enable_gqa`` (which rules out the
memory-efficient kernel on CUDA). The mask is additive (0 / -inf): an all-zero mask (a zero-padded decode row of
a full graph) attends everything on the scratch page and stays finite. A softcap or attention sinks (learned
per-head logits that join the softmax denominator only) take an explicit float32 softmax instead of SDPA; so
does ALiBi (per-head slopes times the key's distance behind the query, added to the scaled scores in float32).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from piecegraph.attention.metadata import AttentionMetadata, BatchLayout, to_device
from piecegraph.attention.pages import SCRATCH_PAGE
from piecegraph.attention.types import CacheShape


@dataclass(frozen=True)
class Group:
    """Sequences padded to one dense problem: ``batch`` sequences of at most ``qmax`` new tokens.

    ``q_index`` ``[batch * qmax]``: the flat token row each padded query takes (pads repeat a real row);
    ``page_table`` ``[batch, width]``; ``mask`` ``[batch, 1, G * qmax, width * page_size]``; ``token_index`` and
    ``out_index`` ``[tokens]``: where each real token sits in the flat batch and in the padded output.
    """

    batch: int
    qmax: int
    q_index: torch.Tensor
    page_table: torch.Tensor
    mask: torch.Tensor
    token_index: torch.Tensor
    out_index: torch.Tensor
    qpos: torch.Tensor | None = None  # [batch, 1, 1, qmax, 1]: each padded query's position (sliding windows)


class TorchBackend:
    """SDPA over gathered pages; see the module docstring. Works on any device torch runs SDPA on."""

    name = "torch"
    kernel = "torch scaled_dot_product_attention over the gathered pages"  # said in results' env
    reads_page_table = True  # decode steps gather pages through AttentionMetadata.page_table

    def __init__(self, config: CacheShape) -> None:
        self.group = config.num_heads // config.num_kv_heads
        self.scale = config.head_dim ** -0.5
        self.plans, self.plan_s = 0, 0.0  # plan calls and their host seconds (the engine reports both)

    # -- planning (host, once per step) -----------------------------------------------------------------
    def plan(self, meta: AttentionMetadata) -> None:
        start = time.perf_counter()
        self._plan(meta)
        self.plans += 1
        self.plan_s += time.perf_counter() - start

    def _plan(self, meta: AttentionMetadata) -> None:
        cache = meta.cache
        if meta.is_decode:
            length = cache.max_pages_per_seq * cache.page_size
            keys = torch.arange(length, device=cache.device)
            mask = torch.zeros(meta.num_tokens, length, dtype=cache.dtype, device=cache.device)
            meta.mask = mask.masked_fill_(keys[None, :] >= meta.kv_lens[:, None], float("-inf"))[:, None, None, :]
            return
        layout = meta.layout
        decode = [i for i, n in enumerate(layout.num_new) if n == 1]
        prefill = [i for i, n in enumerate(layout.num_new) if n > 1]
        meta.plan = tuple(self._group(layout, rows, cache.device, cache.dtype) for rows in (decode, prefill) if rows)

    def _group(self, layout: BatchLayout, rows: list[int], device: torch.device, dtype: torch.dtype) -> Group:
        offsets = [0]
        for n in layout.num_new:
            offsets.append(offsets[-1] + n)
        qmax = max(layout.num_new[i] for i in rows)
        width = max(len(layout.pages[i]) for i in rows)
        host: dict[str, list[int]] = {"q_index": [], "qpos": [], "page_table": [], "token_index": [], "out_index": []}
        for b, i in enumerate(rows):
            new, kv, start = layout.num_new[i], layout.kv_lens[i], offsets[i]
            for j in range(qmax):
                real = j < new
                host["q_index"].append(start + j if real else start)
                host["qpos"].append(kv - new + j if real else 0)
            host["page_table"] += [*layout.pages[i], *(SCRATCH_PAGE,) * (width - len(layout.pages[i]))]
            host["token_index"] += range(start, start + new)
            host["out_index"] += range(b * qmax, b * qmax + new)
        dev = to_device(host, device)
        batch, length = len(rows), width * layout.page_size
        qpos = dev["qpos"].view(batch, 1, 1, qmax, 1)
        keys = torch.arange(length, device=device)
        mask = torch.zeros(batch, 1, self.group, qmax, length, dtype=dtype, device=device)
        mask.masked_fill_(keys > qpos, float("-inf"))  # causal by position; later keys are not written yet
        return Group(batch, qmax, dev["q_index"], dev["page_table"].view(batch, width),
                     mask.view(batch, 1, self.group * qmax, length), dev["token_index"], dev["out_index"], qpos)

    def for_cuda_graph(self, meta: AttentionMetadata, size: int) -> AttentionMetadata:
        return meta  # every decode field is token-aligned: piecegraph's zero padding is harmless

    # -- the op (inside the split op, per layer) --------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int,
                meta: AttentionMetadata, *, scale: float | None = None, window: int | None = None,
                softcap: float | None = None, sinks: torch.Tensor | None = None,
                alibi_slopes: torch.Tensor | None = None) -> None:
        """See :class:`~piecegraph.attention.backends.AttentionBackend`. ``scale`` overrides ``head_dim ** -0.5``;
        ``window`` hides keys at positions <= the query's minus ``window``; ``softcap`` caps scores with tanh;
        ``sinks`` ``[heads]``: one logit per query head added to the softmax denominator (no value);
        ``alibi_slopes`` ``[heads]``: ALiBi, ``slope * (key_position - query_position)`` added to scaled scores."""
        cache = meta.cache
        extra = {"scale": scale or self.scale, "softcap": softcap}
        sink = None if sinks is None else sinks.float().view(1, cache.num_kv_heads, self.group, 1, 1)
        slopes = None if alibi_slopes is None else alibi_slopes.float().view(1, cache.num_kv_heads, self.group, 1, 1)
        kc, vc = cache.k[layer], cache.v[layer]
        heads_kv, dim, vdim = cache.num_kv_heads, cache.head_dim, vc.shape[-1]
        # One index_copy per tensor; pad tokens (slot 0) all land on the scratch page, harmlessly.
        kc.view(-1, heads_kv, dim).index_copy_(0, meta.slot_mapping, k.to(kc.dtype))
        vc.view(-1, heads_kv, vdim).index_copy_(0, meta.slot_mapping, v.to(vc.dtype))
        if meta.is_decode:
            n = q.shape[0]
            mask = meta.mask if window is None else _windowed(meta.mask, (meta.kv_lens - 1).view(n, 1, 1, 1), window)
            bias = _alibi(slopes, (meta.kv_lens - 1).view(n, 1, 1, 1, 1), mask.shape[-1])
            o = self._attend(q.view(n, heads_kv, self.group, dim), kc, vc, meta.page_table, mask,
                             sinks=_sink_column(sink, 1), bias=bias, **extra)
            out.copy_(o.reshape(n, -1, vdim))
            return
        for g in meta.plan:
            qg = q.index_select(0, g.q_index).view(g.batch, g.qmax, heads_kv, self.group, dim)
            qg = qg.permute(0, 2, 3, 1, 4).reshape(g.batch, heads_kv, self.group * g.qmax, dim)
            mask = g.mask
            if window is not None:
                shape = (g.batch, 1, self.group, g.qmax, mask.shape[-1])
                mask = _windowed(mask.view(shape), g.qpos, window).view(mask.shape)
            bias = _alibi(slopes, g.qpos, mask.shape[-1])
            o = self._attend(qg, kc, vc, g.page_table, mask, sinks=_sink_column(sink, g.qmax), bias=bias, **extra)
            o = o.view(g.batch, heads_kv, self.group, g.qmax, vdim).permute(0, 3, 1, 2, 4)
            o = o.reshape(g.batch * g.qmax, heads_kv * self.group, vdim)
            out.index_copy_(0, g.token_index, o.index_select(0, g.out_index))

    def _attend(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, page_table: torch.Tensor,
                mask: torch.Tensor, scale: float, softcap: float | None = None,
                sinks: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``q`` ``[B, Hkv, M, D]`` against the pages of ``page_table`` ``[B, W]``; ``mask`` ``[B, 1, M|1, L]``;
        ``sinks`` ``[1, Hkv, M, 1]`` float32 or ``None``; ``bias`` ``[B, Hkv, M, L]`` float32 (ALiBi) or ``None``.
        Returns ``[B, Hkv, M, Dv]`` (``Dv``: the value cache's width, which may differ from ``D``)."""
        batch, width = page_table.shape
        length = width * kc.shape[1]
        keys = kc[page_table].view(batch, length, kc.shape[2], kc.shape[3]).transpose(1, 2).to(q.dtype)
        values = vc[page_table].view(batch, length, vc.shape[2], vc.shape[3]).transpose(1, 2).to(q.dtype)
        if softcap is None and sinks is None and bias is None:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.to(q.dtype), scale=scale)
        # SDPA has neither: scores, tanh cap, mask, float32 softmax, as Hugging Face's eager attention does
        scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if bias is not None:  # in float32, as MPT adds its float32 bias (BLOOM's, rounded to the model dtype first)
            scores = scores.float() + bias
        scores = scores + mask.to(scores.dtype)
        if sinks is None:
            return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)
        # the sink is one more logit per row with no value: softmax over [scores, sink], then drop its column
        scores = torch.cat([scores.float(), sinks.expand(*scores.shape[:-1], 1)], dim=-1)
        return torch.matmul(torch.softmax(scores, dim=-1)[..., :-1].to(q.dtype), values)


def _sink_column(sink: torch.Tensor | None, qmax: int) -> torch.Tensor | None:
    """``sink`` ``[1, Hkv, G, 1, 1]`` as the rows of a folded problem, ``[1, Hkv, G * qmax, 1]`` (row ``g * qmax + j``:
    query head ``g`` of its kv head, token ``j``)."""
    if sink is None:
        return None
    return sink.expand(-1, -1, -1, qmax, -1).reshape(1, sink.shape[1], -1, 1)


def _alibi(slopes: torch.Tensor | None, qpos: torch.Tensor, length: int) -> torch.Tensor | None:
    """ALiBi's bias for a folded problem: ``slopes`` ``[1, Hkv, G, 1, 1]`` float32 times each key's position
    (``0..length-1``) minus its query's (``qpos`` ``[B, 1, 1, Q, 1]``), as ``[B, Hkv, G * Q, length]``; ``None``
    without slopes."""
    if slopes is None:
        return None
    keys = torch.arange(length, device=slopes.device, dtype=torch.float32)
    bias = slopes * (keys - qpos.to(torch.float32))
    return bias.reshape(bias.shape[0], slopes.shape[1], -1, length)


def _windowed(mask: torch.Tensor, qpos: torch.Tensor, window: int) -> torch.Tensor:
    """``mask`` with -inf where a key's position is <= the query's (``qpos``, broadcast over the last dim)
    minus ``window``: a sliding window (Hugging Face's ``kv_idx > q_idx - sliding_window``). Out of place."""
    keys = torch.arange(mask.shape[-1], device=mask.device)
    return mask.masked_fill(keys <= qpos - window, float("-inf"))
