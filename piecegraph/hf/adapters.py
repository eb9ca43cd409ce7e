"""Wrapping-time changes that make a Hugging Face model's attention piecegraph's: hand-written attention modules
(GPT-Neo's, which computes attention in its own ``_attn`` method, unscaled, over all earlier tokens or a local
window; GPT-NeoX-Japanese's) given the instance attributes of transformers' attention kind and an ``_attn`` that
calls piecegraph's attention function on the flat forward's calls (their own otherwise); and attention modules
with fewer key/value heads than other layers told how often to repeat them (:mod:`piecegraph.hf.families`).
:class:`~piecegraph.hf.HFDecoder`'s wrap applies them (:func:`adapt`) and its unwrap removes them
(:func:`~piecegraph.hf.families.unadapt`).
The numeric self-check (:mod:`piecegraph.hf.probe`) still compares the wrapped model with its own forward.
"""

from __future__ import annotations

from typing import Any

import torch

import piecegraph.hf.families as families
from piecegraph.hf.attention import NAME, is_flat


def _gpt_neo_fields(module: torch.nn.Module, model: torch.nn.Module) -> dict[str, Any]:
    """What makes a GPT-Neo self-attention module of transformers' attention kind while wrapped: its scale (GPT-Neo
    does not scale its logits), window (``"local"`` layers: ``config.window_size``), ``layer_idx`` and an
    ``_attn`` that runs piecegraph's attention on the flat forward's calls and GPT-Neo's own otherwise."""
    local = module.attention_type == "local"
    return {"scaling": 1.0, "sliding_window": int(module.config.window_size) if local else None,
            "layer_idx": module.layer_id, "_attn": _flat_attn.__get__(module)}


def _gpt_neox_japanese_fields(module: torch.nn.Module, model: torch.nn.Module) -> dict[str, Any]:
    """What makes a GPT-NeoX-Japanese attention module of transformers' attention kind while wrapped: the model's
    config, ``is_causal``, its scale (``1 / norm_factor``) and an ``_attn`` as GPT-Neo's."""
    return {"config": model.config, "is_causal": True, "scaling": 1.0 / module.norm_factor,
            "_attn": _flat_attn.__get__(module)}


def _flat_attn(self: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any = None) -> tuple[torch.Tensor, Any]:
    """A hand-written ``_attn(query, key, value, mask) -> ([B, heads, T, dim], weights)`` while wrapped: on a call
    of piecegraph's flat forward (its placeholder mask), the ``"piecegraph"`` attention function (looked up now,
    as transformers' modules look theirs up, so the self-check counts the call) with the module's ``scaling`` and
    ``sliding_window``; otherwise the module's own method."""
    from transformers import AttentionInterface

    if not is_flat(attention_mask, {}):
        return type(self)._attn(self, query, key, value, attention_mask)
    out, _ = AttentionInterface._global_mapping[NAME](self, query, key, value, attention_mask, scaling=self.scaling,
                                                      sliding_window=getattr(self, "sliding_window", None))
    return out.transpose(1, 2), None


# (applies(module), fields(module, model)): hand-written attention modules given those fields while wrapped
HAND_WRITTEN = [(families._is_gpt_neo_attention, _gpt_neo_fields),
                (families._is_gpt_neox_japanese_attention, _gpt_neox_japanese_fields)]


def adapt(model: torch.nn.Module) -> list[tuple[torch.nn.Module, dict[str, Any]]]:
    """Set on each :func:`~piecegraph.hf.families.adaptable` module of ``model`` the instance attributes that make
    it of transformers' attention kind (``scaling``, ``layer_idx``, a window and an attention method calling
    piecegraph's attention function), and on attention modules with fewer key/value heads than others how often
    to repeat them (:func:`~piecegraph.hf.families.kv_repeats`); returns ``(module, attributes set)`` for
    :func:`~piecegraph.hf.families.unadapt` and :func:`~piecegraph.hf.families.readapt`. A module one of whose
    attributes is already an instance attribute is left alone (idempotent)."""
    done = []
    for module in model.modules():
        for applies, fields in HAND_WRITTEN:
            if applies(module) and families.adaptable(module):
                values = fields(module, model)
                if not any(name in module.__dict__ for name in values):
                    module.__dict__.update(values)  # plain instance attributes, not parameters or submodules
                    done.append((module, values))
    return done + families.kv_repeats(model)
