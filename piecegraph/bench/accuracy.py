"""A quantized model's accuracy against its unquantized weights: logits over teacher-forced tokens.

Both models read the same seeded token sequences in one packed prefill (teacher forcing: every position sees the
given tokens, never the model's own choices), eagerly; the reference's logits are kept on the host, so the two
models need not be resident together. The result is one row per quantized model of a ``bench`` result.
"""

from __future__ import annotations

from typing import Any

import torch

from piecegraph.attention import DEFAULT_PAGE_SIZE, AttentionMetadata, KVCache
from piecegraph.attention.kv_cache import pages_for
from piecegraph.context import forward_context
from piecegraph.models import ModelFacts

TOKENS, SEQS = 512, 8  # a few hundred teacher-forced tokens, in sequences of 64


def teacher_forced_logits(model: torch.nn.Module, facts: ModelFacts, tokens: int = TOKENS, seqs: int = SEQS,
                          backend: str = "auto", seed: int = 0) -> torch.Tensor:
    """The float32 ``[tokens, vocab]`` logits (on the host) of ``seqs`` seeded random sequences of ``tokens //
    seqs`` tokens each (the last takes the remainder), run as one prefill on a fresh paged cache of ``facts``'
    shape. ``model`` is a reference decoder (``forward(ids, positions)`` then ``logits(hidden)``); the same
    ``seed`` gives the same tokens for every model of a vocabulary."""
    if tokens < seqs or seqs < 1:
        raise ValueError(f"tokens ({tokens}) must be at least seqs ({seqs}), and seqs at least 1")
    lengths = [tokens // seqs] * seqs
    lengths[-1] += tokens - sum(lengths)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, facts.vocab_size, (tokens,), generator=gen).to(facts.device)
    pages = sum(pages_for(n, DEFAULT_PAGE_SIZE) for n in lengths) + 1  # + the scratch page
    cache = KVCache(facts.config, pages, DEFAULT_PAGE_SIZE, dtype=facts.dtype, device=facts.device,
                    max_seq_len=max(lengths), backend=backend)
    meta = AttentionMetadata.for_batch(cache, [(i, 0, n) for i, n in enumerate(lengths)])
    with torch.no_grad(), forward_context(meta):
        return model.logits(model(ids, meta.positions)).float().cpu()


def accuracy_row(quant: str, logits: torch.Tensor, reference: torch.Tensor, against: str = "bf16",
                 seqs: int = SEQS) -> dict[str, Any]:
    """The result row of ``quant``'s ``logits`` against ``reference`` (``against``'s, the same tokens):
    ``logits_rel_err`` (``||L - R|| / ||R||`` over all positions), its worst position (``logits_rel_err_max``)
    and ``top1_agreement`` (the fraction of positions whose argmax is the reference's)."""
    if logits.shape != reference.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and reference {tuple(reference.shape)} differ in shape")
    diff = logits - reference
    per_position = diff.norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-30)
    return {"key": "accuracy", "mode": "eager", "phase": "accuracy", "quant": quant, "against": against,
            "tokens": logits.shape[0], "seqs": seqs,
            "logits_rel_err": (diff.norm() / reference.norm().clamp_min(1e-30)).item(),
            "logits_rel_err_max": per_position.max().item(),
            "top1_agreement": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()}
