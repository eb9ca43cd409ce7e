"""Paged-by-slot KV cache, attention metadata, and the attention split op of the reference decoder.

The op ``piecegraph_models::attention`` writes the new tokens' k and v into the cache and attends, reading the
batch layout from the forward context. It is a split op: piecegraph cuts the graph there and runs it eagerly
between captured pieces (or captures it too, in ``mode="full"``, which is why the decode path is graph-safe).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from piecegraph.context import get_forward_context
from piecegraph.models.config import ModelConfig
from piecegraph.ops.split import split_op

SCRATCH_SLOT = 0  # cache row that padding tokens (slot 0) write into and read from


class KVCache:
    """Per-layer k and v tensors of shape ``[num_slots + 1, max_len, num_kv_heads, head_dim]``.

    Row 0 is a scratch row: piecegraph pads batches with zeros, so a pad token has slot 0 and position 0 and
    must write somewhere harmless. Real sequences use slots ``1..num_slots``. ``max_len`` defaults to
    ``config.max_seq_len``. The cache is zero-initialized so pad tokens reading the scratch row stay finite.
    """

    def __init__(self, config: ModelConfig, num_slots: int, max_len: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        max_len = config.max_seq_len if max_len is None else max_len
        if num_slots <= 0:
            raise ValueError(f"KVCache num_slots must be positive, got {num_slots}")
        if max_len <= 0:
            raise ValueError(f"KVCache max_len must be positive, got {max_len}")
        self.config = config
        self.num_slots = num_slots
        self.max_len = max_len
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        shape = (num_slots + 1, max_len, config.num_kv_heads, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    def check_slot(self, slot: int) -> None:
        """Raise unless ``slot`` is a real sequence slot (``1..num_slots``)."""
        if not 1 <= slot <= self.num_slots:
            raise ValueError(
                f"slot {slot} is out of range: sequences use slots 1..{self.num_slots} "
                f"(slot {SCRATCH_SLOT} is the scratch row for padding)"
            )


@dataclass
class AttentionMetadata:
    """The batch layout the attention op reads from the forward context.

    ``slots`` and ``positions`` (int64, ``[n]``, on the cache's device) give each token's cache row and position.
    ``seq_bounds`` (host ints, length ``B + 1``, cumulative token offsets) selects the eager varlen path, which
    also needs ``seq_slots`` and ``kv_lens`` (cache length of each sequence after this step); ``None`` means
    decode: every token is the newest token of its own sequence, and the op stays CUDA-graph safe.
    ``n`` may be smaller than the token count the model is called with: the caller padded the batch.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    cache: KVCache
    seq_bounds: tuple[int, ...] | None = None
    seq_slots: tuple[int, ...] | None = None
    kv_lens: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return self.slots.shape[0]

    @classmethod
    def for_batch(cls, cache: KVCache, seqs: Sequence[tuple[int, int, int]],
                  device: torch.device | str | None = None) -> "AttentionMetadata":
        """Metadata of a mixed batch, tokens packed sequence after sequence.

        ``seqs`` holds ``(slot, start_pos, num_new_tokens)`` per sequence: a prefill has ``start_pos`` 0 (or the
        length already cached, for chunked prefill), a decode step has ``num_new_tokens`` 1. Slots must be
        distinct and in ``1..cache.num_slots``; ``start_pos + num_new_tokens`` must fit in ``cache.max_len``.
        """
        device = cache.device if device is None else device
        if not seqs:
            raise ValueError("AttentionMetadata.for_batch needs at least one sequence")
        bounds, slots, positions, kv_lens = [0], [], [], []
        for slot, start, count in seqs:
            cache.check_slot(slot)
            if count <= 0 or start < 0:
                raise ValueError(f"sequence in slot {slot}: need start_pos >= 0 and num_new_tokens >= 1, "
                                 f"got start_pos={start}, num_new_tokens={count}")
            if start + count > cache.max_len:
                raise ValueError(f"sequence in slot {slot} would reach length {start + count}, "
                                 f"beyond the cache's max_len {cache.max_len}")
            slots += [slot] * count
            positions += range(start, start + count)
            bounds.append(bounds[-1] + count)
            kv_lens.append(start + count)
        seq_slots = tuple(s for s, _, _ in seqs)
        if len(set(seq_slots)) != len(seq_slots):
            raise ValueError(f"slots must be distinct within a batch, got {seq_slots}")
        return cls(
            slots=torch.tensor(slots, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            cache=cache, seq_bounds=tuple(bounds), seq_slots=seq_slots, kv_lens=tuple(kv_lens),
        )

    @classmethod
    def for_decode(cls, cache: KVCache, slots: torch.Tensor, positions: torch.Tensor) -> "AttentionMetadata":
        """Decode metadata from tensors only (no host values): one new token per sequence."""
        if slots.shape != positions.shape or slots.dim() != 1:
            raise ValueError(f"slots and positions must be 1-D of equal length, got "
                             f"{tuple(slots.shape)} and {tuple(positions.shape)}")
        return cls(slots=slots.to(torch.int64), positions=positions.to(torch.int64), cache=cache)

    @classmethod
    def dummy(cls, cache: KVCache, n: int, device: torch.device | str | None = None) -> "AttentionMetadata":
        """Decode-style metadata of ``n`` pad tokens (slot 0, position 0): for warm-up and graph capture."""
        device = cache.device if device is None else device
        zeros = torch.zeros(n, dtype=torch.int64, device=device)
        return cls(slots=zeros, positions=zeros.clone(), cache=cache)


def dummy(cache: KVCache, n: int, device: torch.device | str | None = None) -> AttentionMetadata:
    """Shorthand for :meth:`AttentionMetadata.dummy`."""
    return AttentionMetadata.dummy(cache, n, device)


def _decode_attention(q: torch.Tensor, meta: AttentionMetadata, layer: int) -> torch.Tensor:
    """Attention of ``q`` ``[n, H, D]``, one newest token per sequence; shapes depend only on n and the cache.

    The GQA group is folded into SDPA's query-length dimension (``[n, Hkv, G, D]``): every token has one query
    per head and the G heads of a group share a kv head, so this is exact and avoids ``enable_gqa``, which
    keeps SDPA's memory-efficient kernel usable.
    """
    cache = meta.cache
    n, heads, dim = q.shape
    group = heads // cache.num_kv_heads
    k = cache.k[layer][meta.slots].to(q.dtype).transpose(1, 2)  # [n, Hkv, L, D]
    v = cache.v[layer][meta.slots].to(q.dtype).transpose(1, 2)
    steps = torch.arange(cache.max_len, device=q.device)
    mask = (steps[None, :] <= meta.positions[:, None])[:, None, None, :]  # [n, 1, 1, L]
    qg = q.reshape(n, cache.num_kv_heads, group, dim)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=1.0 / math.sqrt(dim))
    return out.reshape(n, heads, dim)


def _varlen_attention(q: torch.Tensor, meta: AttentionMetadata, layer: int) -> torch.Tensor:
    """Attention of packed sequences (eager only: loops over host-side bounds), causal by position."""
    cache = meta.cache
    if meta.seq_slots is None or meta.kv_lens is None:
        raise ValueError("AttentionMetadata with seq_bounds also needs seq_slots and kv_lens")
    if meta.seq_bounds[-1] != q.shape[0]:
        raise ValueError(f"seq_bounds end at {meta.seq_bounds[-1]} but the metadata has {q.shape[0]} tokens")
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    for i, (slot, kv_len) in enumerate(zip(meta.seq_slots, meta.kv_lens)):
        lo, hi = meta.seq_bounds[i], meta.seq_bounds[i + 1]
        k = cache.k[layer][slot, :kv_len].to(q.dtype).transpose(0, 1)[None]  # [1, Hkv, L, D]
        v = cache.v[layer][slot, :kv_len].to(q.dtype).transpose(0, 1)[None]
        steps = torch.arange(kv_len, device=q.device)
        mask = steps[None, :] <= meta.positions[lo:hi, None]  # [m, L]: causal by position, not by index
        qs = q[lo:hi].transpose(0, 1)[None]  # [1, H, m, D]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask[None, None], scale=scale, enable_gqa=True)
        out[lo:hi] = o[0].transpose(0, 1)
    return out


def _attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    """Write the first n tokens' k, v into the cache, attend, fill ``out[:n]``, zero ``out[n:]``."""
    meta = get_forward_context()
    cache = meta.cache
    n, total, dim = meta.slots.shape[0], q.shape[0], cache.head_dim
    if n > total:
        raise ValueError(f"attention metadata covers {n} tokens but the model was called with only {total}")
    kc, vc = cache.k[layer], cache.v[layer]
    # One index_put per tensor: pad tokens (slot 0, position 0) all land on the scratch row, harmlessly.
    kc[meta.slots, meta.positions] = k[:n].reshape(n, cache.num_kv_heads, dim).to(kc.dtype)
    vc[meta.slots, meta.positions] = v[:n].reshape(n, cache.num_kv_heads, dim).to(vc.dtype)
    qn = q[:n].reshape(n, -1, dim)  # reshape: a compiler may hand us non-contiguous strides
    if meta.seq_bounds is None:
        o = _decode_attention(qn, meta, layer)
    else:
        o = _varlen_attention(qn, meta, layer)
    out[:n].copy_(o.reshape(n, -1))
    out[n:].zero_()  # pad rows: zeros, never garbage that could leak into later pieces


def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    return None


# "DEF", not "FRAGMENT": FRAGMENT registration before Inductor's first import broke torch.compile on torch 2.11.
_LIB = torch.library.Library("piecegraph_models", "DEF")
_LIB.define("attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, int layer) -> ()")
for _key in ("CPU", "CUDA"):
    _LIB.impl("attention", _attention_impl, _key)
torch.library.register_fake("piecegraph_models::attention", _attention_fake, lib=_LIB)
split_op("piecegraph_models::attention")
