"""Next-token choice for the rows of a step: one argmax for all, seeded sampling for rows that ask for it."""

from __future__ import annotations

from typing import Sequence

import torch

from piecegraph.serve.request import Request

_SEED_STRIDE = 1_000_003  # a prime: (seed, token index) pairs map to distinct generator seeds


def sample_on_device(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """One token per row of ``logits`` ``[rows, vocab]`` (row ``i`` for ``requests[i]``), int64 on the logits'
    device: nothing is read back to the host, so the caller decides when to wait for them.

    Greedy rows take the argmax. A sampled row draws from ``softmax(logits / temperature)`` (cut to its nucleus
    when ``top_p < 1``: :func:`nucleus`) with a generator
    seeded by the request's seed and the index of the token it emits (:attr:`Request.num_generated`, which counts
    tokens still in flight), so its tokens do not depend on the batch, on preemptions or on whether the engine
    overlaps its steps.
    """
    tokens = logits.argmax(-1)
    sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
    if sampled:
        tokens = tokens.clone()
        for i in sampled:
            request = requests[i]
            gen = torch.Generator(device=logits.device)
            gen.manual_seed(request.params.seed * _SEED_STRIDE + request.num_generated)
            probs = torch.softmax(logits[i].float() / request.params.temperature, dim=-1)
            if request.params.top_p < 1:
                probs = nucleus(probs, request.params.top_p)
            # multinomial(probs, 1)'s own draw (exponential race, argmax) without its validity check, which
            # reads max/min back to the host: a device sync per sampled row
            race = torch.empty_like(probs).exponential_(1, generator=gen)
            tokens[i:i + 1] = (probs / race).argmax(-1, keepdim=True)
    return tokens


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` (a distribution over the last dim) with every token outside the nucleus set to 0: the most likely
    tokens, in order, until their sum reaches ``top_p`` (the most likely one always stays). Not renormalised: the
    draw above only compares ``probs / race``."""
    ordered, order = probs.sort(dim=-1, descending=True)
    keep = (ordered.cumsum(-1) - ordered) < top_p  # the mass before a token is below top_p: it is in the nucleus
    return torch.zeros_like(probs).scatter(-1, order, ordered * keep)


def sample(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """:func:`sample_on_device`, as host ints (one transfer for the whole step: a sync on a GPU)."""
    return sample_on_device(logits, requests).tolist()
