"""The reference the Hugging Face tests compare piecegraph against: transformers' own greedy ``generate``."""

from __future__ import annotations

import torch


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
