"""piecegraph's attention inside an unmodified Hugging Face model, through transformers' ``AttentionInterface``.

Wrapping leaves the model's config as it is. :func:`install` gives each attention module (``self_attn``) a *view*
of its config instead: every field is the config's (the view shares its ``__dict__``, so a change shows in both)
except ``_attn_implementation``, which reads ``"piecegraph"``. The module then calls
:func:`attention`, registered under that name in ``AttentionInterface``. It has two behaviours, chosen by a keyword
argument the flat-token forward passes down (``piecegraph_flat=True``, carried by Hugging Face's ``**kwargs`` from
the base model to every attention call; where a decoder layer drops them, the placeholder attention mask the flat
forward passes, whose dtype no Hugging Face mask has, marks the call instead):

- flat (piecegraph's forward): q, k, v of ``[1, heads, T, head_dim]`` become flat ``[T, heads * head_dim]`` rows
  and go to the split op ``piecegraph_models::attention`` (KV-cache write and paged attention), with the layer's
  softmax scale, sliding window, logit softcap and attention sinks (``s_aux`` / ``sinks``: one learned logit per
  query head) and ALiBi slopes (``alibi_slopes``, one per query head, which piecegraph's adapters of BLOOM's
  and MPT's hand-written attention pass) as arguments. Anything else the model asks for is refused with
  an error naming the model type, never ignored.
- otherwise (Hugging Face's own forward, ``generate``, ``generate_batch``): the function Hugging Face itself would
  call, looked up from the implementation the module's config names *now*. The model's own forward gives exactly
  what it gave, ``set_attn_implementation`` keeps working, and continuous batching's switch to ``"paged|eager"``
  reaches the paged eager function. The config itself never names ``"piecegraph"``, so masks, ``generate`` and
  ``generate_batch``'s checks (it accepts only ``"sdpa"``, ``"paged|eager"`` and flash) see what they saw before.

Attention modules of the fairseq layout that compute attention in their modeling code (XGLM, MVP, TrOCR) are
made of transformers' kind while wrapped by :func:`adapt_projection_attention` (a ``forward`` that calls
:func:`attention` on the flat forward's calls).

:func:`restore` gives the modules their own configs back. The registration is process-wide (every
``AttentionInterface.register`` is) but is nobody's default: only the views name it, and a config set to it by
hand is refused with a message. :func:`release` removes it when the last live wrap is undone (a model dropped
while wrapped counts as live until it is garbage-collected).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

import piecegraph.attention.op  # noqa: F401  (registers torch.ops.piecegraph_models.attention)
from piecegraph.hf.arch import UnsupportedModelError, head_dims, is_projection_attention, model_type
from piecegraph.hf.families import REPEAT, head_adapter
from piecegraph.hf.multi_call import cache_layer
from piecegraph.program import describe

NAME = "piecegraph"
FLAT = "piecegraph_flat"
# The dtype of the flat forward's placeholder mask. transformers builds bool or float masks only, so an attention
# call whose decoder layer dropped the FLAT keyword (its forward does not pass **kwargs on) is still known as flat
# by the mask it passes down.
MASK_DTYPE = torch.uint8
# Keyword arguments of HF attention calls that carry nothing the paged op needs (or that it honours itself).
_IGNORED = frozenset({FLAT, "position_ids", "cache", "past_key_values", "cache_position", "use_cache",
                      "output_attentions", "is_causal", "dropout", "scaling", "sliding_window", "softcap"})
# What some attention keyword arguments piecegraph refuses mean, for the refusal's message.
_FEATURES = {"indices": "sparse attention over selected keys", "position_bias": "an additive position bias"}
# The names transformers' attention calls give learned attention sinks (gpt_oss and kin: ``s_aux``).
_SINKS = ("s_aux", "sinks")
# Instance attribute piecegraph's adapters set on a decoder self-attention that is causal by its model's mask
# though its is_causal says not (BigBird-Pegasus's: piecegraph.hf.adapters_misc)
CAUSAL = "piecegraph_causal"
ALIBI = "alibi_slopes"  # the keyword piecegraph's adapters of ALiBi attention (BLOOM, MPT) pass their slopes by
_users: weakref.WeakSet = weakref.WeakSet()  # the live wraps; "piecegraph" stays registered while there is one
_view_classes: dict[type, type] = {}  # config class -> its view class


def acquire(user: Any) -> None:
    """Register ``"piecegraph"`` with ``AttentionInterface`` for ``user`` (a live wrap; held weakly)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)
    _users.add(user)


def release(user: Any) -> None:
    """Drop ``user``; the last one gone unregisters ``"piecegraph"`` (transformers' registry as it was)."""
    _users.discard(user)
    if _users:
        return
    from transformers import AttentionInterface

    if AttentionInterface._global_mapping.get(NAME) is attention:  # register() has no inverse: its dict
        del AttentionInterface._global_mapping[NAME]


def registered() -> bool:
    """Whether ``"piecegraph"`` is registered with transformers' ``AttentionInterface`` now."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and transformers.AttentionInterface._global_mapping.get(NAME) is attention


def is_view(config: Any) -> bool:
    return bool(getattr(type(config), "_piecegraph_view", False))


def view(config: Any) -> Any:
    """``config`` as a wrapped attention module sees it: every field is ``config``'s (the same ``__dict__``), but
    ``_attn_implementation`` reads ``"piecegraph"``; ``hf_attn_implementation`` is ``config``'s. Copied or
    pickled, it stays a view, of the copy of ``config``."""
    if is_view(config):
        return config
    base = type(config)
    cls = _view_classes.get(base)
    if cls is None:
        cls = type(base.__name__, (base,), {
            "__module__": __name__,
            "__doc__": f"A {base.__name__} as piecegraph's attention modules see it (piecegraph.hf.attention.view).",
            "__slots__": ("piecegraph_config",),  # the config viewed (a slot: the shared __dict__ is the config's)
            "_piecegraph_view": True,
            "_attn_implementation": property(lambda self: NAME),
            "hf_attn_implementation": property(lambda self: self.piecegraph_config._attn_implementation),
            "__eq__": lambda self, other: self.piecegraph_config == getattr(other, "piecegraph_config", other),
            "__reduce_ex__": lambda self, protocol: (view, (self.piecegraph_config,)),
        })
        _view_classes[base] = cls
    out = object.__new__(cls)
    out.__dict__ = config.__dict__  # shared, not copied: a field changed on the config is changed here
    object.__setattr__(out, "piecegraph_config", config)
    return out


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention modules of ``model`` (``self_attn``: a module with ``is_causal``, ``scaling`` and a config)."""
    return [m for m in model.modules()
            if hasattr(m, "is_causal") and hasattr(m, "scaling") and getattr(m, "config", None) is not None]


def install(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Any]]:
    """Give each attention module of ``model`` a :func:`view` of its config; returns ``(module, its own config)``
    for each module changed (none the second time: idempotent). Register with :func:`acquire` first."""
    changed = []
    for module in attention_modules(model):
        if not is_view(module.config):
            changed.append((module, module.config))
            module.config = view(module.config)
    return changed


def restore(changed: list[tuple[torch.nn.Module, Any]]) -> None:
    """Undo :func:`install`: each module gets its own config back."""
    for module, config in changed:
        if is_view(module.config):
            module.config = config


def hf_attention(module: torch.nn.Module) -> Any:
    """The attention function Hugging Face would call for ``module``: its config's implementation, looked up as
    its modeling file looks it up (``eager`` is that file's own eager function: Gemma 2's applies the softcap)."""
    config = module.config
    name = config.hf_attn_implementation if is_view(config) else config._attn_implementation
    if name == NAME:
        raise ValueError(
            f"model_type {model_type(config)!r}: the model's config names the attention implementation {NAME!r}, "
            "which is piecegraph.hf's own: it serves only piecegraph.hf.HFDecoder's flat forward, which selects it "
            "per attention module by itself. Set one of Hugging Face's implementations instead "
            "(model.set_attn_implementation('sdpa')) and wrap the model with piecegraph.hf.HFDecoder(model)")
    source = sys.modules[type(module).__module__]
    functions = getattr(source, "ALL_ATTENTION_FUNCTIONS", None)
    if functions is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as functions
    return functions.get_interface(name, getattr(source, "eager_attention_forward", None))


def placeholder_mask(device: torch.device | str) -> torch.Tensor:
    """The 4D mask the flat forward gives the base model: transformers' mask builders return a 4D mask as it is,
    so no ``[T, T]`` mask is built, and its dtype (:data:`MASK_DTYPE`) marks every attention call it reaches."""
    return torch.zeros(1, 1, 1, 1, dtype=MASK_DTYPE, device=device)


def is_flat(attention_mask: Any, kwargs: dict) -> bool:
    """Whether an attention call comes from piecegraph's flat forward: the FLAT keyword, or the placeholder mask
    (for decoder layers that do not pass the base model's keyword arguments on to attention)."""
    return bool(kwargs.get(FLAT)) or (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4
                                      and attention_mask.dtype == MASK_DTYPE)


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The ``"piecegraph"`` attention function (see the module docstring). Returns ``([1, T, H, Dv], None)``
    (``Dv``: the values' head dim, which may differ from the queries' and keys' ``D``)."""
    if not is_flat(attention_mask, kwargs):
        return hf_attention(module)(module, query, key, value, attention_mask, *args, **kwargs)
    scale, window, softcap = _constants(module, args, kwargs)
    batch, heads, tokens, dim = query.shape
    if batch != 1:
        raise ValueError(f"piecegraph attention runs flat tokens ([1, heads, T, dim]), got query {tuple(query.shape)}")
    adapt, restore = head_adapter(module), None  # a family whose heads the op sees in another order (JetMoE)
    if adapt is not None:
        query, key, value, restore = adapt(module, query, key, value)
    _check_shapes(module, query, key, value, module.config.num_key_value_heads if adapt else None)
    repeat = getattr(module, REPEAT, 1)  # fewer key/value heads than other layers: repeated to the cache's count
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    vdim = value.shape[-1]
    q = query[0].transpose(0, 1).reshape(tokens, heads * dim)
    k = key[0].transpose(0, 1).reshape(tokens, -1)
    v = value[0].transpose(0, 1).reshape(tokens, -1)
    out = q.new_empty(tokens, heads * vdim)  # the op writes here: a stable address for the pieces after the split
    sinks, slopes = _sinks(module, kwargs, heads), _alibi_slopes(module, kwargs, heads)
    torch.ops.piecegraph_models.attention(q, k, v, out, cache_layer(module), scale, window, softcap, sinks, slopes)
    if restore is not None:
        return restore(out.view(tokens, heads, vdim))[None], None
    return out.view(1, tokens, heads, vdim), None


def _constants(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[float, int, float]:
    """``(scale, window, softcap)`` as op arguments (0 / -1 / 0 for none); refuses what the op cannot do."""
    name = model_type(getattr(module, "config", None))
    if args:
        raise UnsupportedModelError(f"model_type {name!r}: its attention call passes positional arguments "
                                    f"{describe(args)} that piecegraph's attention does not know")
    unknown = sorted(k for k, v in kwargs.items() if k not in _IGNORED and k not in _SINKS and k != ALIBI
              and v is not None)
    if unknown:
        what = "".join(f" ({k}: {_FEATURES[k]})" for k in unknown if k in _FEATURES)
        raise UnsupportedModelError(f"model_type {name!r}: its attention asks for {unknown}{what}, which "
                                    "piecegraph's paged attention does not implement (so it refuses rather than "
                                    "ignore them)")
    if not (getattr(module, "is_causal", True) or getattr(module, CAUSAL, False)) or kwargs.get("is_causal") is False:
        raise UnsupportedModelError(f"model_type {name!r}: non-causal attention (is_causal is False)")
    if kwargs.get("dropout"):
        raise UnsupportedModelError(f"model_type {name!r}: attention dropout {kwargs['dropout']} (training?); "
                                    "call model.eval() first")
    scale = kwargs.get("scaling")
    scale = float(scale) if scale is not None else query_scale(module)
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    return scale, int(window) if window else -1, float(softcap) if softcap else 0.0


def _sinks(module: torch.nn.Module, kwargs: dict, heads: int) -> torch.Tensor | None:
    """The layer's attention sinks (``s_aux`` or ``sinks``: one logit per query head, ``[heads]``), or ``None``.
    Refuses sinks of another shape (per-token sinks computed from the hidden states, both names at once)."""
    given = [(name, kwargs[name]) for name in _SINKS if kwargs.get(name) is not None]
    if not given:
        return None
    name, sinks = given[0]
    if len(given) > 1 or not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or sinks.numel() != heads:
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for _, t in given]
        raise UnsupportedModelError(
            f"model_type {model_type(module.config)!r}: its attention passes attention sinks "
            f"{[n for n, _ in given]} of shape {shapes}; piecegraph's paged attention takes one sink logit per "
            f"query head ({name} of shape ({heads},)) only")
    return sinks


def _alibi_slopes(module: torch.nn.Module, kwargs: dict, heads: int) -> torch.Tensor | None:
    """The layer's ALiBi slopes (``alibi_slopes``: ``[heads]``), or ``None``; refuses slopes of another shape."""
    slopes = kwargs.get(ALIBI)
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor) or slopes.dim() != 1 or slopes.numel() != heads:
        shape = tuple(slopes.shape) if isinstance(slopes, torch.Tensor) else type(slopes).__name__
        raise UnsupportedModelError(f"model_type {model_type(module.config)!r}: its attention passes {ALIBI} of "
                                    f"shape {shape}; piecegraph's paged attention takes one slope per query head "
                                    f"(shape ({heads},)) only")
    return slopes


def _check_shapes(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  kv_heads: int | None = None) -> None:
    """Refuse keys and values the paged cache was not shaped for: queries and keys of another size than the
    config's query/key head dim, values of another size than its value head dim (:func:`~piecegraph.hf.arch.head_dims`),
    or another head count than ``kv_heads`` (default: where the module says how many query heads share one,
    ``num_key_value_groups``, kept per rank under tensor parallelism, the heads that gives)."""
    want_qk, want_v = head_dims(module.config)
    groups = getattr(module, "num_key_value_groups", None)
    if kv_heads is None and isinstance(groups, int) and groups > 0:
        kv_heads = query.shape[1] // groups
    for name, tensor, want in (("keys", key, want_qk), ("values", value, want_v)):
        if tensor.shape[-1] == want and query.shape[-1] == want_qk and kv_heads in (None, tensor.shape[1]):
            continue
        mla = (" (multi-head latent attention, run expanded: the config's kv heads must then be its query heads)"
               if getattr(module.config, "kv_lora_rank", None) else "")
        raise UnsupportedModelError(
            f"model_type {model_type(module.config)!r}: its attention's {name} have {tensor.shape[1]} heads of "
            f"{tensor.shape[-1]} (queries: {query.shape[1]} of {query.shape[-1]}; expected "
            f"{kv_heads or 'some'} of {want}, queries of {want_qk}): piecegraph's paged cache holds keys of the "
            f"config's query/key head dim and values of its value head dim{mla}")


def query_scale(module: torch.nn.Module) -> float:
    return float(getattr(module, "scaling", None) or module.head_dim ** -0.5)


# Keyword arguments of a projection attention's own forward that its flat call does not pass on (the cache and
# outputs the flat forward never uses); cross-attention states and MVP's prompt keys are refused when given.
_PROJECTION_OWN = frozenset({"attention_mask", "cache", "past_key_values", "output_attentions", "key_value_states",
                             "attn_prompt"})


def adapt_projection_attention(model: torch.nn.Module) -> list[tuple[torch.nn.Module, dict[str, Any]]]:
    """Give each hand-written attention of the fairseq layout in ``model``
    (:func:`~piecegraph.hf.arch.is_projection_attention`: XGLM, MVP, TrOCR) the instance attributes that make it
    of transformers' attention kind while wrapped: the model's ``config``, ``is_causal`` and a ``forward`` that runs
    the ``"piecegraph"`` attention function on the flat forward's calls and the module's own forward on every
    other call. Returns ``(module, attributes set)``, which :func:`piecegraph.hf.families.unadapt` removes and
    ``readapt`` sets again. A module that has an instance ``forward`` already (another library's hook) is left
    alone: the structure check or the self-check then refuses the model."""
    done = []
    for module in model.modules():
        if is_projection_attention(module) and "forward" not in module.__dict__:
            values = {"config": model.config, "is_causal": True, "forward": _projection_forward.__get__(module)}
            module.__dict__.update(values)  # plain instance attributes: no parameter or submodule is added
            done.append((module, values))
    return done


def _projection_forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """A fairseq-layout attention's forward while wrapped: on a flat call (:func:`is_flat`), its projections'
    queries, keys and values through the ``"piecegraph"`` attention function (looked up now, as transformers'
    modules look theirs up, so the self-check counts the call) with its own ``scaling``, then its output
    projection: ``(output, None)`` as its own forward returns ``(output, weights)``. Other calls: its own forward."""
    from transformers import AttentionInterface

    mask = kwargs.get("attention_mask")
    if args or not is_flat(mask, kwargs):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    given = sorted(k for k in ("key_value_states", "attn_prompt") if kwargs.get(k) is not None)
    if given:
        raise UnsupportedModelError(f"model_type {model_type(self.config)!r}: its attention is given {given} "
                                    "(cross-attention states or prompt keys), which piecegraph's paged attention "
                                    "does not attend")
    batch, tokens = hidden_states.shape[:2]

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.view(batch, tokens, -1, self.head_dim).transpose(1, 2)

    query, key, value = (heads(proj(hidden_states)) for proj in (self.q_proj, self.k_proj, self.v_proj))
    passed = {k: v for k, v in kwargs.items() if k not in _PROJECTION_OWN}
    out, _ = AttentionInterface._global_mapping[NAME](self, query, key, value, mask, scaling=self.scaling, **passed)
    return self.out_proj(out.reshape(batch, tokens, self.embed_dim)), None
