"""The attention split op of the reference decoder: KV-cache write and attention in one op.

``piecegraph_models::attention`` reads the step's :class:`~piecegraph.attention.metadata.AttentionMetadata` from the
forward context and hands the work to the cache's backend (``torch`` or ``flashinfer``). It is a split op:
piecegraph cuts the graph there and runs it eagerly between captured pieces, or captures it too in
``mode="full"`` (pure decode steps, whose metadata is all token-aligned tensors or a backend's static buffers).
Its last five arguments (``scale``, ``window``, ``softcap``, ``sinks``, ``alibi_slopes``; defaults: none) carry
a layer's constants for Hugging Face models (``piecegraph.hf``); the reference decoder leaves them out, so it
runs exactly as before.
"""

from __future__ import annotations

import torch

from piecegraph.context import get_forward_context
from piecegraph.ops.split import split_op


def _attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int,
                    scale: float = 0.0, window: int = -1, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None) -> None:
    """Write the first n tokens' k, v into the cache, attend, fill ``out[:n]``, zero ``out[n:]``.

    ``q``, ``k``: ``head_dim`` per head; ``v`` and ``out``: the cache's ``v_head_dim`` per head (``head_dim``
    unless the model's values are of another width).

    Per-layer constants (Hugging Face models pass them; the reference decoder leaves the defaults): ``scale``
    (0: the backend's ``head_dim ** -0.5``), ``window`` (a sliding window: a query at position p sees keys at
    positions > p - window; -1 or any window >= the cache's ``max_seq_len``: none, since it never excludes a key)
    and ``softcap`` (0: none; else scores become ``softcap * tanh(scores / softcap)`` before the mask);
    ``sinks`` (``None``: none; else learned attention sinks, one logit per query head, float32 or the model's
    dtype: each joins its head's softmax denominator only, as gpt-oss's ``s_aux``; a model parameter, so static
    under full-graph capture); ``alibi_slopes`` (``None``: none; else ALiBi, one float32 slope per query head:
    head h's scores get ``slope_h * (key_position - query_position)`` added after scaling, before the mask; the
    softmax's shift invariance makes this equal to BLOOM's ``slope_h * key_position`` and MPT's bias relative to
    the last key).
    """
    meta = get_forward_context()
    cache = meta.cache
    n, total, dim = meta.num_tokens, q.shape[0], cache.head_dim
    vdim = getattr(cache, "v_head_dim", dim)
    if n > total:
        raise ValueError(f"attention metadata covers {n} tokens but the model was called with only {total}")
    if not 0 <= layer < len(cache.k):
        raise ValueError(f"attention layer {layer} is out of range: the KV cache has {len(cache.k)} layers")
    if n < total:  # a padded bucket: the backend sees only the real rows (slicing costs ~1.5 us a tensor)
        q, k, v, rows = q[:n], k[:n], v[:n], out[:n]
    else:
        rows = out
    # reshape, not view: a compiler may hand us non-contiguous strides
    heads_kv = cache.num_kv_heads
    target = rows.view(n, -1, vdim)  # out: [T, heads * v_head_dim] (values may differ in width from keys)
    extras = _extras(scale, window, softcap, cache.max_seq_len)
    if sinks is not None:
        heads = q.numel() // max(q.shape[0], 1) // dim
        if sinks.numel() != heads:
            raise ValueError(f"attention sinks: {sinks.numel()} values for {heads} query heads (one per head)")
        extras["sinks"] = sinks.reshape(heads)
    if alibi_slopes is not None:
        heads = q.numel() // max(q.shape[0], 1) // dim
        if alibi_slopes.numel() != heads:
            raise ValueError(f"alibi_slopes: {alibi_slopes.numel()} values for {heads} query heads (one per head)")
        extras["alibi_slopes"] = alibi_slopes.reshape(heads)
    cache.backend.forward(q.reshape(n, -1, dim), k.reshape(n, heads_kv, dim), v.reshape(n, heads_kv, vdim), target,
                          layer, meta, **extras)
    if total > n:
        out[n:].zero_()  # pad rows: zeros, never garbage that could leak into later pieces


def _extras(scale: float, window: int, softcap: float, max_seq_len: int) -> dict:
    """The backend keyword arguments of the non-default constants only (the reference decoder passes none)."""
    extras: dict = {}
    if scale:
        extras["scale"] = scale
    if 0 < window < max_seq_len:
        extras["window"] = window
    if softcap:
        extras["softcap"] = softcap
    return extras


def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int,
                    scale: float = 0.0, window: int = -1, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None) -> None:
    return None


# "DEF", not "FRAGMENT": FRAGMENT registration before Inductor's first import broke torch.compile on torch 2.11.
_LIB = LIBRARY = torch.library.Library("piecegraph_models", "DEF")  # mla_op defines its op on it too
_LIB.define("attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, int layer, float scale=0., int window=-1, "
            "float softcap=0., Tensor? sinks=None, Tensor? alibi_slopes=None) -> ()")
for _key in ("CPU", "CUDA"):
    _LIB.impl("attention", _attention_impl, _key)
torch.library.register_fake("piecegraph_models::attention", _attention_fake, lib=_LIB)
split_op("piecegraph_models::attention")
