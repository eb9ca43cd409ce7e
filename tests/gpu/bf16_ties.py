"""Judging greedy divergences in bf16: where two runs' tokens first differ, and whether the reference's two
candidates were so close (in bf16 steps) that kernels equal up to rounding may pick either."""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def bf16_steps(logits: torch.Tensor, a: int, b: int) -> float:
    """How many bfloat16 steps (at the larger of the two logits) separate tokens ``a`` and ``b``."""
    top = torch.maximum(logits[a].abs(), logits[b].abs()).item()
    return abs(logits[a] - logits[b]).item() / 2.0 ** (torch.tensor(top).log2().floor().item() - 7)


def first_divergences(prompts: Sequence[Sequence[int]], got: Sequence[Sequence[int]],
                      expected: Sequence[Sequence[int]], logits_of: Callable[[list[int]], torch.Tensor]
                      ) -> list[dict]:
    """Per prompt whose tokens differ: the first differing step and how many bf16 steps apart the reference's
    logits (``logits_of(prompt + expected tokens before it)``) put the two tokens."""
    ties = []
    for prompt, g, e in zip(prompts, got, expected):
        if g != e:
            i = next(j for j, (a, b) in enumerate(zip(g, e)) if a != b)
            steps = bf16_steps(logits_of(list(prompt) + list(e[:i])), e[i], g[i])
            ties.append({"prompt_len": len(prompt), "step": i, "bf16_steps_apart": steps})
    return ties
