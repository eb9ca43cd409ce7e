"""What the FlashInfer adapter adapts: each serving op's public signature, kind and fake (FlashInfer 0.5.x shapes).

Pure data and shape functions: needs no FlashInfer, so the fakes are tested on any machine
(``tests/cpu/test_flashinfer_adapter.py``). :mod:`piecegraph.adapters.flashinfer` installs them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch

T, OT, OB = torch.Tensor, Optional[torch.Tensor], Optional[bool]
REQUIRED = inspect.Parameter.empty


@dataclass(frozen=True)
class P:
    """One parameter of an adapted function: name, type, default (``REQUIRED`` for none)."""

    name: str
    type: Any
    default: Any = REQUIRED


@dataclass(frozen=True)
class OpSpec:
    """How one FlashInfer function is adapted.

    ``kind``: ``"out"`` (returns a new tensor or writes ``out=``), ``"functional"`` (returns new tensors) or
    ``"inplace"`` (writes ``mutates``, returns None). ``fake`` has the public signature and gives the outputs
    FlashInfer documents (``shape`` says it in words).
    """

    name: str
    module: str  # the flashinfer submodule that defines it
    params: tuple
    kind: str
    fake: Callable
    shape: str
    mutates: tuple = ()
    returns: Any = T


def _round_up(x: Any, m: int) -> Any:
    return (x + m - 1) // m * m


# ----------------------------------------------------------------------------- fakes (the documented shapes)
def fake_like_input(input: T, *args: Any, **kwargs: Any) -> T:
    """rmsnorm, gemma_rmsnorm, layernorm: like ``input`` (2D or 3D)."""
    return torch.empty_like(input)


def fake_none(*args: Any, **kwargs: Any) -> None:
    """In-place ops: nothing new."""
    return None


def fake_act_and_mul(input: T, *args: Any, **kwargs: Any) -> T:
    """silu/gelu/gelu_tanh_and_mul: ``[..., 2d] -> [..., d]``, dtype of ``input``."""
    return input.new_empty((*input.shape[:-1], input.shape[-1] // 2))


def fake_rope(q: T, k: T, *args: Any, **kwargs: Any) -> Tuple[T, T]:
    """apply_rope / apply_rope_pos_ids / apply_llama31_rope*: ``(like q, like k)``."""
    return torch.empty_like(q), torch.empty_like(k)


def fake_rope_cos_sin(positions: T, query: T, key: T, *args: Any, **kwargs: Any) -> Tuple[T, T]:
    """apply_rope_with_cos_sin_cache: ``(like query, like key)``."""
    return torch.empty_like(query), torch.empty_like(key)


def fake_fp4_quantize(input: T, global_scale: OT = None, sf_vec_size: int = 16, sf_use_ue8m0: bool = False,
                      is_sf_swizzled_layout: bool = True, is_sf_8x4_layout: bool = False, enable_pdl: OB = None,
                      backend: str = "cuda", *, pad_sf_cols: bool = False, **newer: Any) -> Tuple[T, T]:
    """fp4_quantize: ``(packed uint8 [..., k/2], scale factors uint8)``, mirroring FlashInfer 0.5.x.

    Scale factors: swizzled -> ``round_up(m, 128 or 8 for 8x4) * round_up(k/sf_vec_size, 4)`` bytes viewed as
    ``[-1, k/sf_vec_size]`` (``pad_sf_cols``: ``[-1, round_up(k/sf_vec_size, 4)]``, newer releases); linear ->
    ``[m, k/sf_vec_size]``. A column-major input (``stride(-2) == 1``) is quantized transposed and both outputs
    are transposed back, as FlashInfer does. Arguments of newer releases (``newer``) do not change the shapes.
    """
    column_major = input.stride(-2) == 1
    if column_major:
        input = input.transpose(-2, -1)
    k = input.shape[-1]
    m = input.numel() // k
    cols = k // sf_vec_size
    x_q = input.new_empty((*input.shape[:-1], k // 2), dtype=torch.uint8)
    if is_sf_swizzled_layout:
        size = _round_up(m, 8 if is_sf_8x4_layout else 128) * _round_up(cols, 4)
        width = _round_up(cols, 4) if pad_sf_cols else cols
    else:
        size, width = m * cols, cols
    sf = input.new_empty((size // width, width), dtype=torch.uint8)
    if column_major:
        x_q, sf = x_q.transpose(-2, -1), sf.transpose(-2, -1)
    return x_q, sf


# ---------------------------------------------------------------------------------------------- the op table
_NORM = (P("input", T), P("weight", T), P("eps", float, 1e-6), P("out", OT, None), P("enable_pdl", OB, None))
_FUSED = (P("input", T), P("residual", T), P("weight", T), P("eps", float, 1e-6), P("enable_pdl", OB, None))
_ACT = (P("input", T), P("out", OT, None), P("enable_pdl", OB, None))
_TAIL = (P("rotary_dim", Optional[int], None), P("interleave", bool, False))
_ROPE_TAIL = _TAIL + (P("rope_scale", float, 1.0), P("rope_theta", float, 1e4))
_LLAMA_TAIL = _TAIL + (P("rope_scale", float, 8.0), P("rope_theta", float, 5e5), P("low_freq_factor", float, 1.0),
                       P("high_freq_factor", float, 4.0), P("old_context_len", int, 8192))
_INDPTR = (P("q", T), P("k", T), P("indptr", T), P("offsets", T))
_POS = (P("q", T), P("k", T), P("pos_ids", T))
_COS_SIN = (P("positions", T), P("query", T), P("key", T), P("head_size", int), P("cos_sin_cache", T),
            P("is_neox", bool, True))
_FP4 = (P("input", T), P("global_scale", OT, None), P("sf_vec_size", int, 16), P("sf_use_ue8m0", bool, False),
        P("is_sf_swizzled_layout", bool, True), P("is_sf_8x4_layout", bool, False), P("enable_pdl", OB, None),
        P("backend", str, "cuda"))
_QK = "(like q, like k)"


def _rope_specs() -> list[OpSpec]:
    specs = []
    for name, params in (("apply_rope", _INDPTR + _ROPE_TAIL), ("apply_rope_pos_ids", _POS + _ROPE_TAIL),
                         ("apply_llama31_rope", _INDPTR + _LLAMA_TAIL),
                         ("apply_llama31_rope_pos_ids", _POS + _LLAMA_TAIL)):
        specs.append(OpSpec(name, "rope", params, "functional", fake_rope, _QK, returns=Tuple[T, T]))
        specs.append(OpSpec(name + "_inplace", "rope", params, "inplace", fake_none, "writes q, k", ("q", "k"), None))
    specs.append(OpSpec("apply_rope_with_cos_sin_cache", "rope", _COS_SIN, "functional", fake_rope_cos_sin,
                        "(like query, like key)", returns=Tuple[T, T]))
    specs.append(OpSpec("apply_rope_with_cos_sin_cache_inplace", "rope", _COS_SIN, "inplace", fake_none,
                        "writes query, key", ("query", "key"), None))
    return specs


def all_specs() -> list[OpSpec]:
    like = "like input"
    half = "[..., 2d] -> [..., d], dtype of input"
    fused = "writes input (normed) and residual (input + residual)"
    return [
        OpSpec("rmsnorm", "norm", _NORM, "out", fake_like_input, like),
        OpSpec("gemma_rmsnorm", "norm", _NORM, "out", fake_like_input, like),
        OpSpec("fused_add_rmsnorm", "norm", _FUSED, "inplace", fake_none, fused, ("input", "residual"), None),
        OpSpec("gemma_fused_add_rmsnorm", "norm", _FUSED, "inplace", fake_none, fused, ("input", "residual"), None),
        OpSpec("layernorm", "norm", (P("input", T), P("gemma", T), P("beta", T), P("eps", float, 1e-6)),
               "functional", fake_like_input, like),
        OpSpec("silu_and_mul", "activation", _ACT, "out", fake_act_and_mul, half),
        OpSpec("gelu_and_mul", "activation", _ACT, "out", fake_act_and_mul, half),
        OpSpec("gelu_tanh_and_mul", "activation", _ACT, "out", fake_act_and_mul, half),
        *_rope_specs(),
        OpSpec("fp4_quantize", "fp4_quantization", _FP4, "functional", fake_fp4_quantize,
               "(uint8 [..., k/2], uint8 scale factors, swizzled: [round_up(m, 128) * round_up(k/16, 4) / (k/16), "
               "k/16])", returns=Tuple[T, T]),
    ]


def fake_specs() -> dict[str, OpSpec]:
    """The adapted ops by name, each with its fake (public signature) and documented shape. Needs no FlashInfer."""
    return {s.name: s for s in all_specs()}
