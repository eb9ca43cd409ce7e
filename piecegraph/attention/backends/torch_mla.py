"""The ``torch`` multi-head latent attention backend: MLA, and DSA's top-k selection, on a latent paged cache.

The cache holds per token the compressed latent ``ckv`` (``cache.k[layer]``, ``[pages, page_size, 1, R]``) and
the rotary key ``kpe`` (``cache.v[layer]``, ``[..., 1, P]``) once for all heads; the query comes absorbed
(``q_nope`` already multiplied by W_UK, so it lives in the latent space) and the output stays there (the model
applies W_UV). Scores ``scale * (q_nope . ckv + q_pe . kpe)``, causal by position, softmax in float32, output
``sum_j p_j ckv_j``.

Vectorized as the ``torch`` backend is: a step is planned once (for all layers) into at most two dense groups
(decode rows; rows with several new tokens; :class:`~piecegraph.attention.backends.torch_sdpa.TorchBackend`'s
planning, with the mask per query token, broadcast over heads), keys gathered from the pages in one index per
group. Large groups are cut along the query axis so that the float32 scores stay within :data:`SCORE_BUDGET`
elements: a loop over chunks, never over tokens.

DSA: with ``topk > 0`` and index tensors, the indexer's score of key ``j`` for query ``t`` is
``sum_h w[t, h] * relu(index_scale * (index_q[t, h] . index_k_j))`` (float32); among the query's causal keys the
``topk`` best are kept (all of them when there are no more than ``topk``) and attention runs over those only
(an additive mask). The selection is kept for the step: a later layer called with ``topk > 0`` and no index
tensors (a "shared" indexer layer) reuses the most recent one of the same step.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from piecegraph.attention.backends.torch_sdpa import Group, TorchBackend
from piecegraph.attention.metadata import AttentionMetadata
from piecegraph.attention.types import CacheShape, PagedCache, index_head_dim, v_head_dim

SCORE_BUDGET = 1 << 26  # float32 score elements per chunk (256 MiB): bounds memory of long prefills


@dataclass(frozen=True)
class Indexer:
    """A DSA layer's indexer inputs for the step's real tokens: ``q`` ``[n, Hi, Di]``, ``weights`` ``[n, Hi]``,
    ``scale`` (the op's ``index_scale``)."""

    q: torch.Tensor
    weights: torch.Tensor
    scale: float


def write_latents(cache: PagedCache, layer: int, slots: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                  index_k: torch.Tensor | None = None) -> None:
    """Write the step's ``ckv`` ``[n, R]``, ``kpe`` ``[n, P]`` (and a DSA layer's ``index_k`` ``[n, Di]``) into
    layer ``layer`` at the flat ``slots`` (one ``index_copy_`` each; pad tokens land on the scratch page)."""
    for store, new in ((cache.k[layer], ckv), (cache.v[layer], kpe)):
        store.view(-1, store.shape[-1]).index_copy_(0, slots, new.reshape(slots.shape[0], -1).to(store.dtype))
    if index_k is not None:
        store = cache.index_k[layer]
        store.view(-1, store.shape[-1]).index_copy_(0, slots, index_k.reshape(slots.shape[0], -1).to(store.dtype))


class TorchMLABackend(TorchBackend):
    """MLA (and DSA) over gathered latent pages; see the module docstring. Any device torch runs on.

    ``plan`` is the torch backend's, with one mask row per query token (``group`` 1): decode steps read
    ``meta.mask`` ``[n, 1, 1, L]``, ``meta.page_table`` and ``meta.kv_lens`` (token-aligned, so a full CUDA graph
    captures them); other steps ``meta.plan``, a tuple of :class:`Group`. The ordinary ``attention`` op refuses
    to run on an MLA cache."""

    name = "torch"
    kernel = "torch latent attention (absorbed queries); DSA: the chosen keys gathered"
    reads_page_table = True

    def __init__(self, config: CacheShape) -> None:
        super().__init__(config)
        self.group = 1  # masks per query token, broadcast over the heads (MLA is one shared latent "head")
        self.scale = (config.head_dim + v_head_dim(config)) ** -0.5  # unused: the mla op always passes its scale
        self.index_head_dim = index_head_dim(config)
        self._selection: tuple[weakref.ref, list[torch.Tensor]] | None = None  # the step's last DSA choice

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int,
                meta: AttentionMetadata, **constants: Any) -> None:
        raise ValueError("this KV cache is a multi-head latent attention (MLA) cache (its config has mla=True): "
                         "call torch.ops.piecegraph_models.mla_attention, not the attention op")

    def mla_forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                    out: torch.Tensor, layer: int, meta: AttentionMetadata, *, scale: float, topk: int = 0,
                    indexer: Indexer | None = None, index_k: torch.Tensor | None = None) -> None:
        """Write the step's latents, attend, fill ``out`` ``[n, H, R]`` (``n = meta.num_tokens``). ``topk`` > 0
        with ``indexer``: DSA with this layer's own selection; ``topk`` > 0 without: the step's last one."""
        write_latents(meta.cache, layer, meta.slot_mapping, ckv, kpe, index_k)
        groups = () if meta.is_decode else meta.plan
        self.attend(q_nope, q_pe, out, layer, meta, groups, scale=scale, topk=topk, indexer=indexer)

    # -- attention over the cache (shared with the flashinfer MLA backend's torch path) -------------------
    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, out: torch.Tensor, layer: int,
               meta: AttentionMetadata, groups: tuple[Group, ...], *, scale: float, topk: int = 0,
               indexer: Indexer | None = None) -> None:
        """Attention of the step's queries over the cache (already written), group by group, into ``out``."""
        reuse = topk > 0 and indexer is None
        chosen = self._reused(meta, layer) if reuse else []
        for i, (rows, pages, mask, place) in enumerate(_rows(meta, groups)):
            qn, qp = (q_nope, q_pe) if rows is None else (q_nope.index_select(0, rows), q_pe.index_select(0, rows))
            batch, heads = pages.shape[0], qn.shape[1]
            qn, qp = qn.reshape(batch, -1, heads, qn.shape[-1]), qp.reshape(batch, -1, heads, qp.shape[-1])
            index = None
            if indexer is not None and topk > 0:
                iq, w = indexer.q, indexer.weights
                if rows is not None:
                    iq, w = iq.index_select(0, rows), w.index_select(0, rows)
                index = (iq.reshape(batch, qn.shape[1], -1, iq.shape[-1]), w.reshape(batch, qn.shape[1], -1, 1))
            o, picked = self._attend_group(meta.cache, layer, qn, qp, pages, mask, scale, topk, index,
                                           chosen[i] if reuse else None, indexer.scale if indexer else 1.0)
            if index is not None:
                chosen.append(picked)
            if place is None:
                out.copy_(o.reshape(out.shape))
            else:
                token_index, out_index = place
                out.index_copy_(0, token_index, o.reshape(-1, heads, o.shape[-1]).index_select(0, out_index))
        if topk > 0 and not reuse:
            self._selection = (weakref.ref(meta), chosen)

    @staticmethod
    def _attend_group(cache: PagedCache, layer: int, qn: torch.Tensor, qp: torch.Tensor, pages: torch.Tensor,
                      mask: torch.Tensor, scale: float, topk: int, index: tuple | None, reused: torch.Tensor | None,
                      index_scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One dense group ``[B, Q, H, *]``, in batch slices whose gathered keys and float32 scores stay within
        :data:`SCORE_BUDGET` (a loop over slices, not rows): the output ``[B, Q, H, R]`` and, with ``index``,
        this layer's DSA choice (key positions ``[B, Q, k]``); ``reused``: an earlier layer's choice. A decode
        step (``Q == 1``) with a choice reads only the chosen keys' latents (:func:`_attend_chosen`); a prefill
        group masks the others out."""
        batch, queries, heads = qn.shape[:3]
        length = pages.shape[1] * cache.page_size
        width = max(heads, index[0].shape[2] if index is not None else 0)
        step = max(1, SCORE_BUDGET // max(1, queries * width * length))
        outs, picks = [], []
        for b0 in range(0, batch, step):
            part = slice(b0, min(batch, b0 + step))
            table, m = pages[part], mask[part]
            n = table.shape[0]
            if index is not None:
                keys = cache.index_k[layer][table].view(n, length, -1)
                picks.append(_select(index[0][part], index[1][part], keys, m, topk, index_scale))
            choice = picks[-1] if index is not None else None if reused is None else reused[part]
            if choice is not None and queries == 1:
                outs.append(_attend_chosen(cache, layer, table, qn[part], qp[part], m, choice, scale))
                continue
            if choice is not None:
                chosen = torch.zeros_like(m, dtype=torch.bool).scatter_(-1, choice.unsqueeze(2), True)
                m = m.masked_fill(~chosen, float("-inf"))
            latent = cache.k[layer][table].view(n, length, -1)
            rope = cache.v[layer][table].view(n, length, -1)
            outs.append(_attend_chunks(qn[part], qp[part], latent, rope, m, scale))
        return _cat(outs), _cat(picks) if picks else None

    def _reused(self, meta: AttentionMetadata, layer: int) -> list[torch.Tensor]:
        last = self._selection
        if last is None or last[0]() is not meta:
            raise ValueError(
                f"mla_attention layer {layer}: topk > 0 without index tensors reuses the DSA selection of an earlier "
                "layer of this step, but no layer of this step made one. Pass index_q, index_weights and index_k "
                "in the first DSA layer (a 'full' indexer layer) before any 'shared' one.")
        return list(last[1])


def _rows(meta: AttentionMetadata, groups: tuple[Group, ...]):
    """Per dense group: (query rows or None for all, page table ``[B, W]``, float32 mask ``[B, Q, 1, L]``,
    (token_index, out_index) or None when the group's output is ``out`` itself)."""
    if meta.is_decode:
        n = meta.num_tokens
        yield None, meta.page_table, meta.mask.float().view(n, 1, 1, -1), None
        return
    for g in groups:
        yield g.q_index, g.page_table, g.mask.float().view(g.batch, g.qmax, 1, -1), (g.token_index, g.out_index)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _chunk(batch: int, queries: int, heads: int, length: int) -> int:
    """Queries per chunk so that ``batch x chunk x heads x length`` float32 scores fit :data:`SCORE_BUDGET`."""
    return max(1, min(queries, SCORE_BUDGET // max(1, batch * heads * length)))


def _attend_chunks(qn: torch.Tensor, qp: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor,
                   mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``qn`` ``[B, Q, H, R]``, ``qp`` ``[B, Q, H, P]`` against ``latent`` ``[B, L, R]``, ``rope`` ``[B, L, P]``
    with the additive float32 ``mask`` ``[B, Q, 1, L]``: ``[B, Q, H, R]`` in the query's dtype."""
    batch, queries, heads, _ = qn.shape
    length = latent.shape[1]
    step = _chunk(batch, queries, heads, length)
    latent, rope = latent.to(qn.dtype), rope.to(qn.dtype)
    parts = []
    for start in range(0, queries, step):
        end = min(queries, start + step)
        rows = (end - start) * heads
        a = qn[:, start:end].reshape(batch, rows, -1)
        b = qp[:, start:end].reshape(batch, rows, -1)
        scores = torch.bmm(a, latent.transpose(1, 2)).float() + torch.bmm(b, rope.transpose(1, 2)).float()
        scores = scores.view(batch, end - start, heads, length) * scale + mask[:, start:end]
        probs = torch.softmax(scores, dim=-1).to(qn.dtype).view(batch, rows, length)
        parts.append(torch.bmm(probs, latent).view(batch, end - start, heads, -1))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _attend_chosen(cache: PagedCache, layer: int, table: torch.Tensor, qn: torch.Tensor, qp: torch.Tensor,
                   mask: torch.Tensor, choice: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode over DSA's chosen keys only: ``choice`` ``[B, 1, k]`` key positions (in the rows of ``table``
    ``[B, W]``) are read straight from the cache's pages, with their ``mask`` ``[B, 1, 1, L]`` entries (a choice
    among fewer than ``k`` causal keys includes masked ones, which stay masked). ``[B, 1, H, R]``."""
    page_size = cache.page_size
    pos = choice.squeeze(1)  # [B, k]
    slots = table.gather(1, pos // page_size) * page_size + pos % page_size
    latent = cache.k[layer].view(-1, cache.k[layer].shape[-1])[slots]  # [B, k, R]
    rope = cache.v[layer].view(-1, cache.v[layer].shape[-1])[slots]
    return _attend_chunks(qn, qp, latent, rope, mask.gather(-1, choice.unsqueeze(2)), scale)


def _select(iq: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, topk: int,
            scale: float) -> torch.Tensor:
    """DSA's choice (key positions ``[B, Q, min(topk, L)]``): per query the ``topk`` causal keys of the highest
    index score ``sum_h w * relu(scale * iq . key)`` (float32; every causal key when there are no more than
    ``topk``, with masked ones filling the rest). ``iq`` ``[B, Q, Hi, Di]``, ``w`` ``[B, Q, Hi, 1]``, ``keys``
    ``[B, L, Di]``, ``mask`` its causal mask."""
    batch, queries, heads, _ = iq.shape
    k = min(topk, keys.shape[1])
    width = _causal_width(mask, k)
    keys, mask = keys[:, :width], mask[..., :width]
    length = keys.shape[1]
    iq, w, keys_t = iq.float(), w.float(), keys.float().transpose(1, 2)
    step = _chunk(batch, queries, heads, length)
    chosen = torch.empty(batch, queries, k, dtype=torch.int64, device=keys.device)
    for start in range(0, queries, step):
        end = min(queries, start + step)
        dots = torch.bmm(iq[:, start:end].reshape(batch, -1, iq.shape[-1]), keys_t)
        dots = torch.relu(dots.view(batch, end - start, heads, length) * scale)
        score = (dots * w[:, start:end]).sum(dim=2) + mask[:, start:end, 0]  # [B, q, L]
        chosen[:, start:end] = score.topk(k, dim=-1).indices
    return chosen


def _causal_width(mask: torch.Tensor, k: int) -> int:
    """On a CPU, the step's widest causal reach (at least ``k``): the key columns past it are masked in every row,
    only there because pages round the width up. Scoring without them leaves ``topk`` the same tensor a model
    without pages scores (transformers': its exact context), so where ReLU makes scores tie exactly (at 0), the
    tie goes the same way whatever the page size. On other devices (a sync, and full graphs need a fixed width)
    the whole width."""
    width = mask.shape[-1]
    if mask.device.type != "cpu" or width <= k:
        return width
    reach = torch.nonzero((mask[:, :, 0] == 0).any(0).any(0))
    return max(k, int(reach[-1]) + 1) if len(reach) else width
