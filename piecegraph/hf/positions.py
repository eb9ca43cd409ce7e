"""Each token's own position for decoders that number positions themselves (BART, Marian, mBART, Pegasus,
Blenderbot, PLBart as causal LMs).

Their decoder's forward takes no ``position_ids``: it counts ``arange(seq_len) + cache_length`` itself and hands
that to its position module (``embed_positions``: learned, with BART's offset of 2, or sinusoidal), as its keyword
``position_ids``. piecegraph's flat forward packs every sequence's tokens into one row without a Hugging Face
cache, so that count would be wrong for all but the first sequence's first chunk. :class:`FlatPositions` gives
each such position module a forward pre-hook that, during the flat forward only, replaces the ``position_ids``
the decoder passes with the tokens' real positions (the flat forward's ``positions``), so that the module's own
code (offset, sinusoid table) computes the embedding exactly as transformers does. Outside the flat forward
(the model's own forward, ``generate``) the hook changes nothing; :meth:`FlatPositions.remove` takes the hooks
off again.

A position module is hooked only when the module holding it (``embed_positions``) has a forward without
``position_ids`` (so the positions the flat forward passes never reach it) and the position module's forward
takes ``position_ids`` and a cache length. Decoders that read ``position_ids`` (OPT, BioGPT, XGLM) are left alone,
and so is RoBERTa's kin (RoBERTa, CamemBERT, XLM-RoBERTa, Data2VecText...): given no ``position_ids`` their
embeddings number from the padding index on and skip pad tokens, but transformers' ``generate`` always gives them
``position_ids`` counted from 0 (for an unpadded prompt), which the flat forward's positions are, so their greedy
tokens equal ``generate``'s as they are (the numeric self-check calls their own forward as ``generate`` does).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

_COUNTERS = ("cache_length", "past_key_values_length")  # the cache-length parameter a self-numbering module takes


def _parameters(fn: Any) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def self_numbering_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The position modules of ``model`` that the decoder holding them feeds a count of its own (see the module
    docstring): those whose positions the flat forward must give."""
    found = []
    for owner in model.modules():
        embed = getattr(owner, "embed_positions", None)
        if not isinstance(embed, torch.nn.Module) or "position_ids" in _parameters(owner.forward):
            continue
        takes = _parameters(embed.forward)
        if "position_ids" in takes and takes & set(_COUNTERS) and all(embed is not m for m in found):
            found.append(embed)
    return found


class FlatPositions:
    """The position hooks of one wrapped model, and the positions of the flat forward running now (``None``
    outside it: the hooks then leave every call as it is)."""

    def __init__(self) -> None:
        self.modules: list[torch.nn.Module] = []
        self.current: torch.Tensor | None = None

    def install(self, model: torch.nn.Module) -> None:
        """Hook ``model``'s self-numbering position modules (idempotent)."""
        for module in self_numbering_modules(model):
            if all(module is not m for m in self.modules):
                module.register_forward_pre_hook(self._hook, with_kwargs=True)
                self.modules.append(module)

    def remove(self) -> None:
        """Take every hook this object put on off again (a copied model's modules hold its copy's hooks)."""
        for module in self.modules:
            for key, hook in list(module._forward_pre_hooks.items()):
                if getattr(hook, "__self__", None) is self:
                    del module._forward_pre_hooks[key]
                    module._forward_pre_hooks_with_kwargs.pop(key, None)
        self.modules = []
        self.current = None

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.current is None:  # the model's own forward: its own count
            return None
        # (input_ids or shape, cache_length): the count the decoder made is replaced, whether passed by keyword or
        # by position; the cache length is 0 in the flat forward (no Hugging Face cache) and unused with positions
        return args[:2], {**kwargs, "position_ids": self.current}
