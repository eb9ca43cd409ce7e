"""Next-token choice for the rows of a step: one argmax for all, seeded sampling for rows that ask for it."""

from __future__ import annotations

from typing import Sequence

import torch

from piecegraph.serve.request import Request

_SEED_STRIDE = 1_000_003  # a prime: (seed, token index) pairs map to distinct generator seeds


def sample(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """One token per row of ``logits`` ``[rows, vocab]`` (row ``i`` for ``requests[i]``), as host ints.

    Greedy rows take the argmax. A sampled row draws from ``softmax(logits / temperature)`` with a generator
    seeded by the request's seed and the index of the token it emits, so its tokens do not depend on the batch
    or on preemptions. One host transfer for the whole step.
    """
    tokens = logits.argmax(-1)
    sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
    if sampled:
        tokens = tokens.clone()
        for i in sampled:
            request = requests[i]
            gen = torch.Generator(device=logits.device)
            gen.manual_seed(request.params.seed * _SEED_STRIDE + len(request.output))
            probs = torch.softmax(logits[i].float() / request.params.temperature, dim=-1)
            tokens[i] = torch.multinomial(probs, 1, generator=gen)[0]
    return tokens.tolist()
