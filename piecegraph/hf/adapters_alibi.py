"""Wrapping-time adapters of ALiBi attention written out in the modeling code: BLOOM's and MPT's.

Both compute attention in their own forward, with a per-head linear position bias (ALiBi) their base model builds
once per forward: BLOOM ``slope_h * key_position`` (``build_alibi_tensor``, slopes from ``_get_alibi_slopes``)
added by ``baddbmm``; MPT ``slope_h * (key_position - last_key_position)`` (``build_mpt_alibi_tensor`` with its
default ``alibi_bias_max`` of 8, as ``MptModel`` calls it). The softmax is shift invariant per row, so both equal
``slope_h * (key_position - query_position)``, which piecegraph's attention op adds (its ``alibi_slopes``).

While wrapped, each attention module gets the instance attributes of transformers' attention kind (``config``,
``is_causal``, ``scaling``) and a ``forward`` that, on a call of piecegraph's flat forward, projects queries, keys
and values with the module's own weights and calls the ``"piecegraph"`` attention function with the model's
slopes, then the module's own output code; every other call runs its own forward. The base models get what lets
the flat forward's placeholder mask through: BLOOM's ``build_alibi_tensor`` (which would read the mask as
``[batch, length]``) returns an unused bias for it; MPT's base model, which turns the mask into a bool one (losing
the placeholder's dtype) and does not pass keyword arguments on to its layers, is given, on a flat call, a
placeholder of a shape no transformers mask has (:data:`MPT_FLAT_MASK_SHAPE`), by which its attention knows the
call. :func:`~piecegraph.hf.families.unadapt` removes all of it. The numeric self-check still compares the wrapped
model with its own forward.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

import piecegraph.hf.families as families
from piecegraph.hf.attention import FLAT, MASK_DTYPE, NAME, is_flat

# MPT's flat-call mask: transformers' causal masks are [batch, 1, queries, keys]; this one has 2 in the head dim.
MPT_FLAT_MASK_SHAPE = (1, 2, 1, 1)


def _modeling(module: torch.nn.Module) -> Any:
    return sys.modules[type(module).__module__]


def _given(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    return {**dict(zip(families.forward_parameters(module), args)), **kwargs}


def _piecegraph_attention(module: torch.nn.Module, qkv: tuple, mask: torch.Tensor, scaling: float,
                          slopes: torch.Tensor) -> torch.Tensor:
    """The ``"piecegraph"`` attention function (looked up now, as transformers' modules look theirs up, so the
    self-check counts the call) on ``[1, heads, T, dim]`` queries, keys, values: ``[1, T, heads * dim]``."""
    from transformers import AttentionInterface

    query, key, value = qkv
    out, _ = AttentionInterface._global_mapping[NAME](module, query, key, value, mask, scaling=scaling,
                                                      alibi_slopes=slopes)
    return out.reshape(1, query.shape[2], -1)


# -- BLOOM --------------------------------------------------------------------------------------------------------

def _bloom_fields(module: torch.nn.Module, model: torch.nn.Module) -> dict[str, Any]:
    """BLOOM's attention of transformers' kind while wrapped: config, causal, ``scaling = inv_norm_factor``."""
    return {"config": model.config, "is_causal": True, "scaling": module.inv_norm_factor,
            "forward": functools.partial(_bloom_forward, module)}


def _bloom_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """BLOOM's attention forward while wrapped (see the module docstring): ``(output, None)`` on a flat call, its
    output projection (tensor-parallel slices where ``slow_but_exact``) and dropout-add of ``residual`` as its own."""
    given = _given(self, args, kwargs)
    mask = given.get("attention_mask")
    if not is_flat(mask, given):
        return type(self).forward(self, *args, **kwargs)
    modeling = _modeling(self)
    hidden = given["hidden_states"]
    slopes = modeling._get_alibi_slopes(self.num_heads, hidden.device)
    context = _piecegraph_attention(self, self._reshape(self.query_key_value(hidden)), mask, self.inv_norm_factor,
                                    slopes)
    if self.pretraining_tp > 1 and self.slow_but_exact:
        width = self.hidden_size / self.pretraining_tp
        output = torch.zeros_like(context)
        for i in range(self.pretraining_tp):
            cols = slice(int(i * width), int((i + 1) * width))
            output = output + torch.nn.functional.linear(context[:, :, cols], self.dense.weight[:, cols])
    else:
        output = self.dense(context)
    return modeling.dropout_add(output, given["residual"], self.hidden_dropout, self.training), None


def _is_bloom_model(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "BloomModel" and callable(getattr(module, "build_alibi_tensor", None))


def _bloom_model_fields(module: torch.nn.Module, model: torch.nn.Module) -> dict[str, Any]:
    return {"build_alibi_tensor": functools.partial(_bloom_alibi, module)}


def _bloom_alibi(self: torch.nn.Module, attention_mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> Any:
    """BLOOM's ``build_alibi_tensor`` while wrapped: for the flat forward's placeholder mask, a zero bias its
    attention (adapted: it passes slopes instead) never reads; otherwise its own."""
    if is_flat(attention_mask, {}):
        return torch.zeros(num_heads, 1, 1, dtype=dtype, device=attention_mask.device)
    return type(self).build_alibi_tensor(self, attention_mask, num_heads, dtype)


# -- MPT ----------------------------------------------------------------------------------------------------------

def _mpt_fields(module: torch.nn.Module, model: torch.nn.Module) -> dict[str, Any]:
    """MPT's attention of transformers' kind while wrapped: config, causal, ``scaling = softmax_scale``."""
    return {"config": model.config, "is_causal": True, "scaling": module.softmax_scale,
            "forward": functools.partial(_mpt_forward, module)}


def _mpt_flat(mask: Any) -> bool:
    return isinstance(mask, torch.Tensor) and tuple(mask.shape) == MPT_FLAT_MASK_SHAPE


def _mpt_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """MPT's attention forward while wrapped (see the module docstring): on a flat call (the mask of
    :data:`MPT_FLAT_MASK_SHAPE`), its ``Wqkv`` (clipped by ``clip_qkv``) through piecegraph's attention with
    ``build_mpt_alibi_tensor``'s slopes, then ``out_proj``: ``(output, None)``."""
    given = _given(self, args, kwargs)
    mask = given.get("attention_mask")
    if not _mpt_flat(mask):
        return type(self).forward(self, *args, **kwargs)
    hidden = given["hidden_states"]
    mixed = self.Wqkv(hidden)
    if self.clip_qkv:
        mixed = mixed.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    qkv = tuple(x.reshape(1, hidden.shape[1], self.n_heads, self.head_dim).transpose(1, 2)
                for x in mixed.chunk(3, dim=2))
    # column 0 of a 2-key bias is -slope exactly (MptModel builds it with the default alibi_bias_max)
    slopes = -_modeling(self).build_mpt_alibi_tensor(self.n_heads, 2, device=hidden.device)[:, 0, 0]
    flat = torch.zeros(1, 1, 1, 1, dtype=MASK_DTYPE, device=hidden.device)  # the placeholder the function knows
    return self.out_proj(_piecegraph_attention(self, qkv, flat, self.softmax_scale, slopes)), None


def _is_mpt_model(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "MptModel" and callable(getattr(module, "build_mpt_alibi_tensor", None))


def _mpt_model_fields(module: torch.nn.Module, model: torch.nn.Module) -> dict[str, Any]:
    return {"forward": functools.partial(_mpt_model_forward, module)}


def _mpt_model_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """MPT's base model forward while wrapped: on a flat call (the FLAT keyword and the placeholder mask), its own
    forward given the mask of :data:`MPT_FLAT_MASK_SHAPE` instead (transformers passes a 4D mask through as it
    is); otherwise its own forward unchanged."""
    given = _given(self, args, kwargs)
    mask = given.get("attention_mask")
    if given.get(FLAT) and isinstance(mask, torch.Tensor) and is_flat(mask, {}):
        kwargs = {**{k: v for k, v in given.items() if k != FLAT},
                  "attention_mask": torch.zeros(MPT_FLAT_MASK_SHAPE, dtype=mask.dtype, device=mask.device)}
        return type(self).forward(self, **kwargs)
    return type(self).forward(self, *args, **kwargs)


# (applies(module), fields(module, model)): hand-written attention modules given those fields while wrapped
HAND_WRITTEN = [(families._is_bloom_attention, _bloom_fields), (families._is_mpt_attention, _mpt_fields)]
# (applies(module), fields(module, model)): base models given those fields while wrapped
BASE_MODELS = [(_is_bloom_model, _bloom_model_fields), (_is_mpt_model, _mpt_model_fields)]


def adapt_bases(model: torch.nn.Module) -> list[tuple[torch.nn.Module, dict[str, Any]]]:
    """Give the base models of :data:`BASE_MODELS` in ``model`` their fields (left alone where one is an instance
    attribute already); returns ``(module, attributes set)`` for :func:`~piecegraph.hf.families.unadapt`."""
    return families.set_fields(model, BASE_MODELS)
