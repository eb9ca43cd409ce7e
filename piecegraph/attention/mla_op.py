"""The multi-head latent attention split op: latent KV-cache write and absorbed MLA (optionally DSA) in one op.

``piecegraph_models::mla_attention(q_nope, q_pe, ckv, kpe, out, layer, scale, topk=0, index_q=None,
index_weights=None, index_k=None, index_scale=1.0)`` reads the step's
:class:`~piecegraph.attention.metadata.AttentionMetadata` from the forward context, like the ``attention`` op,
and hands the work to the cache's MLA backend (a cache whose config has ``mla = True``: ``torch`` or
``flashinfer``). A split op: piecegraph cuts the graph there (or captures it in ``mode="full"`` decode graphs).

Shapes (``T`` tokens, ``H`` heads, latent ``R`` = the cache's ``head_dim``, rotary ``P`` = its ``v_head_dim``):
``q_nope`` ``[T, H, R]`` (the query absorbed through W_UK), ``q_pe`` ``[T, H, P]`` (rotary applied), ``ckv``
``[T, R]`` and ``kpe`` ``[T, P]`` (the new tokens' latent and rotary key, written to ``cache.k`` / ``cache.v``),
``out`` ``[T, H, R]``: the output in latent space (the model applies W_UV); pad rows (``t >= num_tokens``)
zeroed. DSA (``topk > 0``): ``index_q`` ``[T, Hi, Di]``, ``index_weights`` ``[T, Hi]``, ``index_k`` ``[T, Di]``
(written to ``cache.index_k``) select each query's ``topk`` keys; ``topk > 0`` without them reuses the selection
of the most recent layer of the step that had them. See ``backends/torch_mla.py`` for the exact semantics.
"""

from __future__ import annotations

import torch

from piecegraph.attention.backends.torch_mla import Indexer
from piecegraph.attention.op import LIBRARY
from piecegraph.context import get_forward_context
from piecegraph.ops.split import split_op


def _mla_attention_impl(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                        out: torch.Tensor, layer: int, scale: float, topk: int = 0,
                        index_q: torch.Tensor | None = None, index_weights: torch.Tensor | None = None,
                        index_k: torch.Tensor | None = None, index_scale: float = 1.0) -> None:
    """See the module docstring: write the first n tokens' latents, attend, fill ``out[:n]``, zero ``out[n:]``."""
    meta = get_forward_context()
    cache = meta.cache
    n, total = meta.num_tokens, q_nope.shape[0]
    _check(cache, n, total, layer, scale, topk, (index_q, index_weights, index_k))
    indexer = None
    if index_q is not None:
        indexer, index_k = Indexer(index_q[:n], index_weights[:n], float(index_scale)), index_k[:n]
    rows = out[:n] if n < total else out
    cache.backend.mla_forward(q_nope[:n], q_pe[:n], ckv[:n], kpe[:n], rows, layer, meta, scale=float(scale),
                              topk=int(topk), indexer=indexer, index_k=index_k)
    if total > n:
        out[n:].zero_()  # pad rows: zeros, never garbage that could leak into later pieces


def _check(cache, n: int, total: int, layer: int, scale: float, topk: int, index: tuple) -> None:
    """Refuse, naming the argument, what the op cannot run exactly."""
    if not hasattr(cache.backend, "mla_forward"):
        raise ValueError("mla_attention needs a KV cache built for multi-head latent attention (a config with "
                         f"mla=True); this cache's backend {getattr(cache.backend, 'name', '?')!r} runs the "
                         "ordinary attention op")
    if n > total:
        raise ValueError(f"attention metadata covers {n} tokens but mla_attention was called with only {total}")
    if not 0 <= layer < len(cache.k):
        raise ValueError(f"mla_attention layer {layer} is out of range: the KV cache has {len(cache.k)} layers")
    if not scale > 0:
        raise ValueError(f"mla_attention scale must be positive (the softmax scale of the un-absorbed query/key "
                         f"head), got {scale}")
    given = [t is not None for t in index]
    if any(given) and not all(given):
        raise ValueError("mla_attention: pass index_q, index_weights and index_k together (a DSA indexer layer) "
                         "or none of them")
    if topk < 0:
        raise ValueError(f"mla_attention topk must be >= 0 (0: dense MLA), got {topk}")
    if topk == 0 and any(given):
        raise ValueError("mla_attention: index tensors were given with topk=0; pass the indexer's topk (> 0)")
    if any(given) and not getattr(cache, "index_k", None):
        raise ValueError("mla_attention: index tensors were given but the KV cache has no indexer key cache "
                         "(build it from a config with index_head_dim > 0)")
    if any(given) and not cache.index_k[layer].numel():
        raise ValueError(f"mla_attention layer {layer}: index tensors were given, but the cache keeps no indexer keys "
                         "for this layer (its config's indexer_types calls it 'shared'); build the cache from the "
                         "model's config")


def _mla_attention_fake(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                        out: torch.Tensor, layer: int, scale: float, topk: int = 0,
                        index_q: torch.Tensor | None = None, index_weights: torch.Tensor | None = None,
                        index_k: torch.Tensor | None = None, index_scale: float = 1.0) -> None:
    return None


LIBRARY.define("mla_attention(Tensor q_nope, Tensor q_pe, Tensor ckv, Tensor kpe, Tensor(a!) out, int layer, "
               "float scale, int topk=0, Tensor? index_q=None, Tensor? index_weights=None, Tensor? index_k=None, "
               "float index_scale=1.) -> ()")
for _key in ("CPU", "CUDA"):
    LIBRARY.impl("mla_attention", _mla_attention_impl, _key)
torch.library.register_fake("piecegraph_models::mla_attention", _mla_attention_fake, lib=LIBRARY)
split_op("piecegraph_models::mla_attention")
