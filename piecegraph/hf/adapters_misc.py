"""Wrapping-time adapters of two more kinds of Hugging Face attention: OpenAI GPT's (GPT-1) hand-written attention
and the decoder self-attention of an encoder-decoder family that does not declare itself causal (BigBird-Pegasus).

- OpenAI GPT computes attention in its ``_attn`` method (keys given as ``[batch, heads, dim, T]``, logits divided
  by ``sqrt(head_dim)``, its own causal ``bias`` buffer). Its base model turns any attention mask into a float
  mask of two more dimensions, so the flat forward's placeholder mask loses its dtype on the way. While wrapped,
  the base model's ``forward``, on a flat call (piecegraph's keyword and placeholder mask), runs its own forward
  with a mask of a shape no transformers mask has (:data:`OPENAI_FLAT_MASK_SHAPE`), by which each attention
  module's ``_attn`` knows the call and runs the ``"piecegraph"`` attention function; every other call is its own.
- BigBird-Pegasus's decoder builds ``self_attn`` without ``is_causal`` (its eager attention is causal by the mask
  its decoder builds with ``create_causal_mask``). While wrapped, a decoder layer's ``self_attn`` of transformers'
  kind with ``is_decoder`` set and ``is_causal`` False is marked causal for piecegraph's attention only
  (:data:`~piecegraph.hf.attention.CAUSAL`; its own ``is_causal`` is unchanged, so the model's own forward is too).
  Its cross-attention (``encoder_attn``) is left unmarked: a flat call reaching it is refused as non-causal.

:func:`~piecegraph.hf.families.unadapt` removes all of it; the numeric self-check (:mod:`piecegraph.hf.probe`)
still compares the wrapped model with its own forward, so a marked attention that is not causal is refused.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

import piecegraph.hf.families as families
from piecegraph.hf.arch import decoder_layers
from piecegraph.hf.attention import CAUSAL, FLAT, NAME, is_flat, placeholder_mask

# The mask OpenAI GPT's base model is given on a flat call; its attention sees it as [1, 1, *this] (two dims added)
OPENAI_FLAT_MASK_SHAPE = (1, 2, 1, 1)


def _given(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    return {**dict(zip(families.forward_parameters(module), args)), **kwargs}


# -- OpenAI GPT ---------------------------------------------------------------------------------------------------

def _openai_fields(module: torch.nn.Module, model: torch.nn.Module) -> dict[str, Any]:
    """OpenAI GPT's attention of transformers' kind while wrapped: the model's config, causal, its scale
    (``1 / sqrt(head_dim)`` where ``scale`` is set, else 1), its layer's index and an ``_attn`` as described in the
    module docstring."""
    layer = next(i for i, block in enumerate(decoder_layers(model)) if any(m is module for m in block.modules()))
    head = module.split_size // module.n_head
    return {"config": model.config, "is_causal": True, "scaling": 1.0 / math.sqrt(head) if module.scale else 1.0,
            "layer_idx": layer, "_attn": functools.partial(_openai_attn, module)}


def _openai_flat(mask: Any) -> bool:
    return isinstance(mask, torch.Tensor) and tuple(mask.shape) == (1, 1, *OPENAI_FLAT_MASK_SHAPE)


def _openai_attn(self: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Any = None, output_attentions: bool = False) -> list[torch.Tensor]:
    """OpenAI GPT's ``_attn`` while wrapped: on a flat call (the mask of :data:`OPENAI_FLAT_MASK_SHAPE`), the
    ``"piecegraph"`` attention function (looked up now, so the self-check counts the call) on its queries, keys
    (given transposed) and values: ``[out [1, heads, T, dim]]`` as its own returns. Otherwise its own method."""
    from transformers import AttentionInterface

    if not _openai_flat(attention_mask):
        return type(self)._attn(self, query, key, value, attention_mask, output_attentions)
    out, _ = AttentionInterface._global_mapping[NAME](self, query, key.transpose(-1, -2), value,
                                                      placeholder_mask(query.device), scaling=self.scaling)
    return [out.transpose(1, 2)]


def _is_openai_model(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "OpenAIGPTModel" and isinstance(getattr(module, "h", None), torch.nn.ModuleList)


def _openai_model_fields(module: torch.nn.Module, model: torch.nn.Module) -> dict[str, Any]:
    return {"forward": functools.partial(_openai_model_forward, module)}


def _openai_model_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """OpenAI GPT's base model forward while wrapped: on a flat call (the FLAT keyword and the placeholder mask),
    its own forward given the mask of :data:`OPENAI_FLAT_MASK_SHAPE` instead; otherwise its own forward."""
    given = _given(self, args, kwargs)
    mask = given.get("attention_mask")
    if given.get(FLAT) and isinstance(mask, torch.Tensor) and is_flat(mask, {}):
        kwargs = {**{k: v for k, v in given.items() if k != FLAT},
                  "attention_mask": torch.zeros(OPENAI_FLAT_MASK_SHAPE, dtype=mask.dtype, device=mask.device)}
        return type(self).forward(self, **kwargs)
    return type(self).forward(self, *args, **kwargs)


# (applies(module), fields(module, model)): hand-written attention modules given those fields while wrapped
HAND_WRITTEN = [(families._is_openai_gpt_attention, _openai_fields)]
# (applies(module), fields(module, model)): base models given those fields while wrapped
BASE_MODELS = [(_is_openai_model, _openai_model_fields)]


# -- decoder self-attention causal by its mask ---------------------------------------------------------------------

def _causal_by_mask(attn: Any) -> bool:
    """A decoder layer's ``self_attn`` of transformers' kind that says it is a decoder's (``is_decoder``) but not
    causal (``is_causal`` False): BigBird-Pegasus's, causal by the mask its decoder builds."""
    return (attn is not None and getattr(attn, "is_causal", None) is False and getattr(attn, "is_decoder", None)
            is True and hasattr(attn, "scaling") and getattr(attn, "config", None) is not None)


def adapt(model: torch.nn.Module) -> list[tuple[torch.nn.Module, dict[str, Any]]]:
    """Give the base models of :data:`BASE_MODELS` in ``model`` their fields and mark each decoder layer's
    self-attention that is causal by its mask (:func:`_causal_by_mask`) with
    :data:`~piecegraph.hf.attention.CAUSAL` (left alone where an attribute is an instance attribute already);
    returns ``(module, attributes set)`` for :func:`~piecegraph.hf.families.unadapt`."""
    done = families.set_fields(model, BASE_MODELS)
    for layer in decoder_layers(model):
        attn = getattr(layer, "self_attn", None)
        if _causal_by_mask(attn) and CAUSAL not in attn.__dict__:
            values = {CAUSAL: True}
            attn.__dict__.update(values)
            done.append((attn, values))
    return done
