"""Wrapping-time changes that make a Hugging Face model's attention piecegraph's: hand-written attention modules
(GPT-Neo's, which computes attention in its own ``_attn`` method, unscaled, over all earlier tokens or a local
window; GPT-NeoX-Japanese's) given the instance attributes of transformers' attention kind and an ``_attn`` that
calls piecegraph's attention function on the flat forward's calls (their own otherwise); BERT-style decoder
self-attention computed in its forward (MegatronBERT's, RemBERT's, RoFormer's with its rotary embedding, BigBird's
full attention) given such attributes and a ``forward`` of that kind; ALiBi attention (BLOOM's, MPT's:
:mod:`piecegraph.hf.adapters_alibi`) likewise, with what their base models need; and attention modules with
fewer key/value heads than other layers told how often to repeat them (:mod:`piecegraph.hf.families`).
:class:`~piecegraph.hf.HFDecoder`'s wrap applies them (:func:`adapt`) and its unwrap removes them
(:func:`~piecegraph.hf.families.unadapt`).
The numeric self-check (:mod:`piecegraph.hf.probe`) still compares the wrapped model with its own forward.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

import piecegraph.hf.adapters_alibi as adapters_alibi
import piecegraph.hf.adapters_misc as adapters_misc
import piecegraph.hf.families as families
from piecegraph.hf.arch import UnsupportedModelError, model_type
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


def _bert_fields(module: torch.nn.Module, model: torch.nn.Module) -> dict[str, Any]:
    """What makes a BERT-style decoder self-attention (:func:`~piecegraph.hf.families._is_bert_self_attention`:
    MegatronBERT's, RemBERT's, RoFormer's, BigBird's full attention) of transformers' attention kind while
    wrapped: the model's config, ``is_causal``, its scale (its logits are divided by ``sqrt(attention_head_size)``)
    and a ``forward`` that runs piecegraph's attention on the flat forward's calls and its own otherwise."""
    return {"config": model.config, "is_causal": True, "scaling": 1.0 / math.sqrt(module.attention_head_size),
            "forward": functools.partial(_bert_forward, module, families.forward_parameters(module))}


# a BERT-style self-attention's own arguments that its flat call does not pass on to the attention function
_BERT_OWN = frozenset({"hidden_states", "attention_mask", "sinusoidal_pos", "encoder_hidden_states",
                       "encoder_attention_mask", "cache", "past_key_values", "output_attentions"})


def _bert_forward(self: torch.nn.Module, parameters: tuple[str, ...], *args: Any, **kwargs: Any) -> Any:
    """A BERT-style self-attention's forward while wrapped (``parameters``: its own forward's, after ``self``).
    On a flat call (:func:`~piecegraph.hf.attention.is_flat`): its ``query``, ``key`` and ``value`` projections,
    RoFormer's rotary embedding applied by its own ``apply_rotary_position_embeddings`` to what its own forward
    applies it to (``sinusoidal_pos``, which the flat forward's position hook computed at the tokens' positions),
    then the ``"piecegraph"`` attention function (looked up now, so the self-check counts the call): returns
    ``(output [B, T, all_head_size], None)`` as its own forward returns ``(output, weights)``. Other calls: its
    own forward. Cross-attention states on a flat call are refused."""
    from transformers import AttentionInterface

    given = {**dict(zip(parameters, args)), **kwargs}
    mask = given.get("attention_mask")
    if not is_flat(mask, given):
        return type(self).forward(self, *args, **kwargs)
    if given.get("encoder_hidden_states") is not None:
        raise UnsupportedModelError(f"model_type {model_type(self.config)!r}: its attention is given "
                                    "encoder_hidden_states (cross-attention), which piecegraph's paged attention "
                                    "does not attend")
    hidden = given["hidden_states"]
    batch, tokens = hidden.shape[:2]

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.view(batch, tokens, -1, self.attention_head_size).transpose(1, 2)

    query, key, value = (heads(proj(hidden)) for proj in (self.query, self.key, self.value))
    rotary = given.get("sinusoidal_pos")
    if rotary is not None:
        if self.rotary_value:
            query, key, value = self.apply_rotary_position_embeddings(rotary, query, key, value)
        else:
            query, key = self.apply_rotary_position_embeddings(rotary, query, key)
    passed = {k: v for k, v in given.items() if k not in _BERT_OWN}
    out, _ = AttentionInterface._global_mapping[NAME](self, query, key, value, mask, scaling=self.scaling, **passed)
    return out.reshape(batch, tokens, self.all_head_size), None


# (applies(module), fields(module, model)): hand-written attention modules given those fields while wrapped
HAND_WRITTEN = [(families._is_gpt_neo_attention, _gpt_neo_fields),
                (families._is_gpt_neox_japanese_attention, _gpt_neox_japanese_fields),
                (families._is_bert_self_attention, _bert_fields), *adapters_alibi.HAND_WRITTEN,
                *adapters_misc.HAND_WRITTEN]


def uses_alibi(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds attention that passes ALiBi slopes while wrapped (BLOOM's, MPT's)."""
    return any(applies(m) for m in model.modules() for applies, _ in adapters_alibi.HAND_WRITTEN)


def adapt(model: torch.nn.Module) -> list[tuple[torch.nn.Module, dict[str, Any]]]:
    """Set on each :func:`~piecegraph.hf.families.adaptable` module of ``model`` the instance attributes that make
    it of transformers' attention kind (``scaling``, ``layer_idx``, a window and an attention method calling
    piecegraph's attention function), and on attention modules with fewer key/value heads than others how often
    to repeat them (:func:`~piecegraph.hf.families.kv_repeats`); returns ``(module, attributes set)`` for
    :func:`~piecegraph.hf.families.unadapt` and :func:`~piecegraph.hf.families.readapt`. A module one of whose
    attributes is already an instance attribute is left alone (idempotent)."""
    done = families.set_fields(model, HAND_WRITTEN, only=families.adaptable)
    return done + adapters_alibi.adapt_bases(model) + adapters_misc.adapt(model) + families.kv_repeats(model)
