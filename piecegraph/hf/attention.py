"""piecegraph's attention inside an unmodified Hugging Face model, through transformers' ``AttentionInterface``.

:func:`install` registers one attention function, ``"piecegraph"``, and switches a model to it. The function
has two behaviours, chosen by a keyword argument the flat-token forward passes down (``piecegraph_flat=True``,
carried by Hugging Face's ``**kwargs`` from the base model to every attention call):

- flat (piecegraph's forward): q, k, v of ``[1, heads, T, head_dim]`` become flat ``[T, heads * head_dim]`` rows
  and go to the split op ``piecegraph_models::attention`` (KV-cache write and paged attention), with the layer's
  softmax scale, sliding window and logit softcap as arguments. Anything else the model asks for is refused with
  an error naming the model type, never ignored.
- otherwise (Hugging Face's own forward and ``generate``): the implementation the model had before, unchanged,
  and its own mask function (registered under ``"piecegraph"`` in ``AttentionMaskInterface``, dispatching the
  same way), so the model's own forward gives exactly what it gave before.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

import piecegraph.attention.op  # noqa: F401  (registers torch.ops.piecegraph_models.attention)
from piecegraph.hf.arch import UnsupportedModelError, model_type

NAME = "piecegraph"
FLAT = "piecegraph_flat"
_PREVIOUS = "_piecegraph_previous_attn"  # attribute on each attention module: the implementation it had
# Keyword arguments of HF attention calls that carry nothing the paged op needs (or that it honours itself).
_IGNORED = frozenset({FLAT, "position_ids", "cache", "past_key_values", "cache_position", "use_cache",
                      "output_attentions", "is_causal", "dropout", "scaling", "sliding_window", "softcap"})
_registered = False


def register() -> None:
    """Register ``"piecegraph"`` with transformers' attention and mask interfaces (once per process)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, _mask)
    _registered = True


def install(model: Any) -> None:
    """Switch ``model``'s attention to ``"piecegraph"``, remembering each module's previous implementation.

    Idempotent. The previous implementation keeps serving every call that is not piecegraph's flat forward.
    """
    register()
    previous = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if previous == NAME:
        return
    for module in model.modules():
        if hasattr(module, "is_causal") and hasattr(module, "scaling"):  # an attention module
            setattr(module, _PREVIOUS, previous)
    _configs_previous[id(model.config)] = previous
    model.config._attn_implementation = NAME


_configs_previous: dict[int, str] = {}  # config id -> its previous implementation (for the mask function)


def _previous_attention(module: torch.nn.Module) -> Any:
    from transformers import AttentionInterface

    name = getattr(module, _PREVIOUS, "sdpa")
    if name == "eager" or name not in AttentionInterface._global_mapping:
        # Each modeling file has its own eager attention (Gemma 2's applies the softcap): take that one.
        return sys.modules[type(module).__module__].eager_attention_forward
    return AttentionInterface._global_mapping[name]


def _mask(*args: Any, config: Any = None, **kwargs: Any) -> Any:
    """The mask of the model's previous implementation (the flat forward passes its own and never gets here)."""
    from transformers.masking_utils import AttentionMaskInterface

    previous = _configs_previous.get(id(config), "sdpa")
    fn = AttentionMaskInterface._global_mapping.get(previous, AttentionMaskInterface._global_mapping["sdpa"])
    return fn(*args, config=config, **kwargs)


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``"piecegraph"`` attention function (see the module docstring). Returns ``([1, T, H, D], None)``."""
    if not kwargs.get(FLAT):
        return _previous_attention(module)(module, query, key, value, attention_mask, *args, **kwargs)
    scale, window, softcap = _constants(module, args, kwargs)
    batch, heads, tokens, dim = query.shape
    if batch != 1:
        raise ValueError(f"piecegraph attention runs flat tokens ([1, heads, T, dim]), got query {tuple(query.shape)}")
    q = query[0].transpose(0, 1).reshape(tokens, heads * dim)
    k = key[0].transpose(0, 1).reshape(tokens, -1)
    v = value[0].transpose(0, 1).reshape(tokens, -1)
    out = torch.empty_like(q)  # the op writes here: a stable address for the pieces after the split
    torch.ops.piecegraph_models.attention(q, k, v, out, module.layer_idx, scale, window, softcap)
    return out.view(1, tokens, heads, dim), None


def _constants(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[float, int, float]:
    """``(scale, window, softcap)`` as op arguments (0 / -1 / 0 for none); refuses what the op cannot do."""
    name = model_type(getattr(module, "config", None))
    if args:
        raise UnsupportedModelError(f"model_type {name!r}: its attention call passes positional arguments "
                                    f"{args!r} that piecegraph's attention does not know")
    unknown = sorted(k for k, v in kwargs.items() if k not in _IGNORED and v is not None)
    if unknown:
        raise UnsupportedModelError(f"model_type {name!r}: its attention asks for {unknown}, which piecegraph's "
                                    "paged attention does not implement (so it refuses rather than ignore them)")
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise UnsupportedModelError(f"model_type {name!r}: non-causal attention (is_causal is False)")
    if kwargs.get("dropout"):
        raise UnsupportedModelError(f"model_type {name!r}: attention dropout {kwargs['dropout']} (training?); "
                                    "call model.eval() first")
    scale = kwargs.get("scaling")
    scale = float(scale) if scale is not None else query_scale(module)
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    return scale, int(window) if window else -1, float(softcap) if softcap else 0.0


def query_scale(module: torch.nn.Module) -> float:
    return float(getattr(module, "scaling", None) or module.head_dim ** -0.5)
