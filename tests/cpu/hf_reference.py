"""The references tests compare piecegraph against: transformers' own greedy ``generate`` for Hugging Face models,
and float64 attention over dense keys for the attention op (with the op's run on a padded bucket)."""

from __future__ import annotations

import torch

from piecegraph.attention import AttentionMetadata, KVCache
from piecegraph.context import forward_context
from piecegraph.models import TINY

# the op's tests: 6 query heads over 2 key/value heads of 8, on the torch backend
ATTENTION_CFG = TINY.replace(num_heads=6, num_kv_heads=2, head_dim=8, attention_backend="torch")
STEPS = [  # (seq, cached, new): prompts; decode rows with a new prompt and a chunk over pages; pure decode
    [("a", 0, 9), ("b", 0, 3)],
    [("a", 9, 1), ("b", 3, 4), ("c", 0, 6)],
    [("a", 10, 1), ("b", 7, 1), ("c", 6, 1)],
]


def generation_eos(model) -> set[int]:
    """The EOS ids of ``model.generation_config`` (one id or a list; none: an empty set)."""
    eos = model.generation_config.eos_token_id
    return {eos} if isinstance(eos, int) else set(eos or ())


def transformers_greedy(model, prompt: list[int], new: int, eos: set[int] | None = None, **kwargs) -> list[int]:
    """transformers' greedy new tokens for one prompt (all-ones attention mask: every prompt token attends, as
    piecegraph reads a prompt), cut after the first of ``eos`` (default :func:`generation_eos`), which is kept, as
    piecegraph keeps it. ``kwargs`` go to ``generate`` (``eos_token_id``, ``pad_token_id``, ...)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             **kwargs)
    tokens = out[0, len(prompt):].tolist()
    stop = generation_eos(model) if eos is None else eos
    if kwargs.get("eos_token_id") is not None and eos is None:
        given = kwargs["eos_token_id"]
        stop = {given} if isinstance(given, int) else set(given)
    return tokens[: next((i + 1 for i, t in enumerate(tokens) if t in stop), len(tokens))]


def dense_attention(keys: dict, values: dict, seqs, q, k, v, weights, window) -> torch.Tensor:
    """Float64 attention of one step, token by token over each sequence's dense keys (``keys`` and ``values``, by
    sequence, gain the step's ``k`` and ``v``). ``weights(scores, h, first, pos)`` turns query head ``h``'s scaled
    scores over the keys at ``first..pos`` into its weights. ``window`` > 0: keys at positions <= the query's minus
    it are hidden. ``q``: (tokens, heads, dim); ``k``, ``v``: (tokens, kv heads, dim)."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    out, row, group = [], 0, heads // kv_heads
    for seq, cached, new in seqs:
        keys[seq] = torch.cat([keys.get(seq, k.new_zeros(0, kv_heads, dim)), k[row:row + new]])
        values[seq] = torch.cat([values.get(seq, v.new_zeros(0, kv_heads, dim)), v[row:row + new]])
        for i in range(new):
            pos = cached + i
            first = max(0, pos - window + 1) if window > 0 else 0
            for h in range(heads):
                scores = keys[seq][first:pos + 1, h // group] @ q[row + i, h] / dim ** 0.5
                out.append(weights(scores, h, first, pos) @ values[seq][first:pos + 1, h // group])
        row += new
    return torch.stack(out).view(-1, heads, dim)


def run_attention_op(cache, seqs, q, k, v, window, *extra, pad) -> torch.Tensor:
    """The attention op's output for one step of ``seqs`` on ``cache`` (layer 0), its inputs padded with ``pad``
    random rows; asserts the pad rows come out zero. ``extra``: the op's arguments after its softcap (sinks,
    ALiBi slopes). Returns float32 (tokens, heads, dim)."""
    meta = AttentionMetadata.for_batch(cache, seqs)
    n = meta.num_tokens
    padded = [torch.cat([x.reshape(n, -1).float(), torch.randn(pad, x[0].numel())]) for x in (q, k, v)]
    out = torch.full((n + pad, q[0].numel()), float("nan"))
    with forward_context(meta):
        torch.ops.piecegraph_models.attention(*padded, out, 0, 0.0, window, 0.0, *extra)
    assert (out[n:] == 0).all()  # pad rows come out zero
    return out[:n].view(q.shape)


def two_token_prompt(flat: bool):
    """A 2-token prompt's metadata on a small cache of :data:`ATTENTION_CFG`, random ``q``, ``k``, ``v`` and an empty
    ``out``: (tokens, heads * dim) where ``flat`` (as the op takes them), else (tokens, heads, dim) (as a backend)."""
    heads, kv_heads, dim = ATTENTION_CFG.num_heads, ATTENTION_CFG.num_kv_heads, ATTENTION_CFG.head_dim
    cache = KVCache(ATTENTION_CFG, num_pages=8, page_size=4, max_seq_len=16)
    meta = AttentionMetadata.for_batch(cache, [("a", 0, 2)])
    shape, kv_shape = ((heads * dim,), (kv_heads * dim,)) if flat else ((heads, dim), (kv_heads, dim))
    return meta, torch.randn(2, *shape), torch.randn(2, *kv_shape), torch.randn(2, *kv_shape), torch.empty(2, *shape)
