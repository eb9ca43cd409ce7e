"""What a Hugging Face model must be for piecegraph to run it, and the cache shape read from its config.

Support is decided by evidence, never by ``model_type``: :func:`check_supported` reads the config (what it
declares: encoder-decoder, multimodal, layer kinds, attention options), :func:`check_structure` the built model
(a causal LM whose decoder layers and attention modules are where the flat forward reaches them), and
:func:`piecegraph.hf.probe.verify` runs it (each layer's attention through the interface, numbers equal).
Everything here reads attributes only; nothing imports transformers.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any

from piecegraph.hf.families import adaptable, block_sparse_refusal, kv_heads_refusal, layer_kind_refusal
from piecegraph.models.config import ModelConfig
from piecegraph.models.mla_config import MODEL_TYPES as MLA_MODEL_TYPES

# Config fields that change attention in ways the split op does not implement: (field, why), refused when set.
_REFUSED_FIELDS = (
    ("use_bidirectional_attention", "bidirectional (non-causal) attention"),
    ("attention_chunk_size", "chunked local attention"),
)
# config.layer_types entries that are softmax attention over the whole cache or a sliding window of it
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
MAX_DEFAULT_CACHE_LEN = 4096  # as ModelConfig.from_hf: a 128k default would make every cache huge


class UnsupportedModelError(ValueError):
    """A Hugging Face model piecegraph cannot run exactly; the message names its model_type and the reason."""


def model_type(config: Any) -> str:
    return str(getattr(config, "model_type", "") or type(config).__name__)


def check_supported(config: Any, experts_impl: str | None = None) -> None:
    """Raise :class:`UnsupportedModelError` naming ``config.model_type`` and the feature when the config alone
    shows a model piecegraph's engine cannot run: an encoder-decoder, a multimodal wrapper (a text config inside
    the config), layers that are not attention (``config.layer_types`` naming linear attention, Mamba,
    convolutions...), non-causal or chunked attention, or a mixture-of-experts layer whose experts
    implementation is ``"eager"`` (a Python loop over the experts a batch hits: data-dependent, so Dynamo cannot
    trace it whole; ``grouped_mm`` or ``batched_mm`` can). No model type is refused by name: what passes here
    is checked on the model itself by :func:`check_structure` and numerically by :mod:`piecegraph.hf.probe`.
    The model types the engine's MLA decoder runs (:data:`~piecegraph.models.mla_config.MODEL_TYPES`, DeepSeek
    sparse attention included) pass: that decoder reads and checks their config itself.
    """
    name = model_type(config)
    if name in MLA_MODEL_TYPES:
        return  # run by the engine's MLA decoder (piecegraph.hf.mla), whose MLAConfig.from_hf reads and checks it
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"model_type {name!r}: an encoder-decoder model; piecegraph.hf runs "
                                    "decoder-only causal LMs")
    text = _text_config(config)
    if text is not None:
        raise UnsupportedModelError(
            f"model_type {name!r}: a multimodal wrapper around a {model_type(text)!r} text model; piecegraph.hf "
            "runs decoder-only causal LMs (load the text model alone, if its weights allow)")
    kinds = sorted({str(k) for k in (getattr(config, "layer_types", None) or ())} - ATTENTION_LAYER_TYPES)
    if kinds:
        raise UnsupportedModelError(layer_kind_refusal(name, kinds, MLA_MODEL_TYPES) or (
            f"model_type {name!r}: config.layer_types names {kinds}, layers that are not softmax attention over "
            "a KV cache (recurrent, linear-attention, convolutional or chunked layers); piecegraph's paged "
            "attention runs full and sliding-window attention only"))
    try:
        shape = (config.num_attention_heads, head_dim(config), getattr(config, "num_key_value_heads", None))
    except Exception as err:  # noqa: BLE001  (e.g. transformers' per-layer attributes that refuse a global read)
        raise UnsupportedModelError(f"model_type {name!r}: its config has no one attention shape for all layers "
                                    f"({type(err).__name__}: {str(err)[:160]}); piecegraph's paged cache holds "
                                    "one shape of keys and values") from None
    del shape
    for field, what in _REFUSED_FIELDS:
        if getattr(config, field, None):
            raise UnsupportedModelError(f"model_type {name!r}: config.{field} is set ({what}); piecegraph's "
                                        "attention is causal paged attention only")
    if getattr(config, "recurrent_kv_cache_mode", None) == "last_loop":  # (dory) per_loop runs, a layer per loop
        raise UnsupportedModelError(
            f"model_type {name!r}: config.recurrent_kv_cache_mode is 'last_loop': its looped layers' earlier loops "
            "attend over the keys and values the last loop cached, so its forward with a cache differs from its "
            "forward without one; piecegraph runs each loop on a cache of its own (recurrent_kv_cache_mode="
            "'per_loop')")
    if getattr(config, "alibi", None):  # MPT's attn_config.alibi: its attention is adapted (adapters_alibi)
        raise UnsupportedModelError(f"model_type {name!r}: its config enables ALiBi added to the attention mask "
                                    "(head-wise slopes times distance, built by its base model into the mask); "
                                    "piecegraph's attention takes ALiBi slopes from BLOOM's and MPT's attention "
                                    "only, not from a mask")
    if experts_impl == "eager":
        raise UnsupportedModelError(
            f"model_type {name!r}: its experts run with experts_implementation='eager', a Python loop over the "
            "experts each batch hits, which Dynamo cannot trace as one graph. Load it with "
            "experts_implementation='batched_mm' (or 'grouped_mm'), e.g. "
            "AutoModelForCausalLM.from_pretrained(path, experts_implementation='batched_mm')."
        )


def _alibi_field(config: Any) -> bool | None:
    """The config's ALiBi switch (``config.alibi``, Falcon; ``config.attn_config.alibi``, MPT), or ``None`` when
    it has none."""
    for holder in (config, getattr(config, "attn_config", None)):
        value = getattr(holder, "alibi", None) if holder is not None else None
        if value is not None:
            return bool(value)
    return None


def _text_config(config: Any) -> Any:
    """The text sub-config of a multimodal config (``text_config`` beside a vision or audio one), else None."""
    text = getattr(config, "text_config", None)
    return text if text is not None and text is not config else None


def check_structure(model: Any) -> None:
    """Raise :class:`UnsupportedModelError` (``TypeError`` for a base model without an output head) when
    ``model`` is not built the way piecegraph's flat forward relies on: a causal LM with a base model
    (:func:`base_model`: ``model.model``, or the module its ``base_model_prefix`` names, e.g. GPT-2's
    ``transformer``) holding its decoder layers as one ``torch.nn.ModuleList`` of ``num_hidden_layers`` layers,
    each with a self-attention module (:func:`layer_attention`) wherever the list sits (``model.layers``,
    ``transformer.h``, ``model.decoder.layers``...), and an output head (:func:`output_head`); each layer's
    attention of transformers' kind (or a hand-written one piecegraph adapts: :mod:`piecegraph.hf.families`), and
    key/value head counts the paged cache can hold (the largest a multiple of each layer's). Whether
    each layer's attention goes through transformers' attention interface (by its config's
    ``_attn_implementation``) exactly once, and the whole computes what the model computes, is the run-time
    evidence of :func:`piecegraph.hf.probe.verify` (transformers' own class flag,
    ``_supports_attention_backend``, is not used: it also marks models whose layers reach the interface but
    drop its keyword arguments, which piecegraph runs)."""
    name = model_type(model.config)
    base = base_model(model)
    if base is None:
        if getattr(model, "get_output_embeddings", lambda: None)() is None and not hasattr(model, "lm_head"):
            raise TypeError(f"{type(model).__name__} ({name!r}) is not a *ForCausalLM with a base model and an "
                            "output head: pass the causal LM (AutoModelForCausalLM), not its base model")
        raise UnsupportedModelError(f"model_type {name!r}: {type(model).__name__} has no base model (neither "
                                    "model.model nor the module its base_model_prefix names)")
    if not output_head_names(model):
        raise UnsupportedModelError(f"model_type {name!r}: {type(model).__name__} has no output head piecegraph "
                                    "can call apart from its base model (model.lm_head, or the child module "
                                    "holding get_output_embeddings())")
    layers = decoder_layers(model)
    if not layers:
        raise UnsupportedModelError(f"model_type {name!r}: its base model {type(base).__name__} has no list of "
                                    f"{decoder_field(model.config, 'num_hidden_layers')} decoder layers (a "
                                    "torch.nn.ModuleList of num_hidden_layers modules)")
    plain = [i for i, layer in enumerate(layers) if layer_attention(layer) is None]
    if plain and _alibi_field(model.config) is None and hasattr(sys.modules.get(type(base).__module__),
                                                                 "build_alibi_tensor"):
        raise UnsupportedModelError(f"model_type {name!r}: its attention adds ALiBi biases (its modeling code "
                                    "builds them: build_alibi_tensor) in attention computed in the modeling code; "
                                    "piecegraph's paged attention has no additive bias and does not implement "
                                    "ALiBi")
    if plain:
        raise UnsupportedModelError(block_sparse_refusal(name, layers[plain[0]], base_model_name(model)) or
            f"model_type {name!r}: decoder layers {plain} ({type(layers[plain[0]]).__name__}) hold no causal "
            "attention module of transformers' kind (with is_causal, scaling and a config: the modules that call "
            "transformers' attention interface); a recurrent, convolutional, ALiBi-biased or hand-written "
            "attention layer, which piecegraph's paged attention does not run")
    _check_attention_kind(name, layers)
    mixed = kv_heads_refusal(name, [layer_attention(layer) for layer in layers],
                             decoder_field(model.config, "num_attention_heads"))
    if mixed:
        raise UnsupportedModelError(mixed)


def _check_attention_kind(name: str, layers: list[Any]) -> None:
    """Refuse decoder layers whose self-attention holds no module of transformers' attention kind (is_causal,
    scaling, a config): piecegraph's attention would never be called there. The message names what the layer's
    attention module lacks (a module that does not declare itself causal may build a mask of its own, e.g. a
    per-key bias, which the paged op cannot apply)."""
    bare = [i for i, layer in enumerate(layers) if not any(_is_attention(m) for m in layer.modules())]
    if not bare:
        return
    attn = layer_attention(layers[bare[0]])
    lacks = [a for a in ("is_causal", "scaling", "config") if getattr(attn, a, None) is None]
    raise UnsupportedModelError(
        f"model_type {name!r}: decoder layers {bare} hold an attention module ({type(attn).__name__}) without "
        f"{' or '.join(lacks)}, which piecegraph needs of a module it runs through its paged attention (causal "
        "attention of transformers' kind; an attention that does not declare itself causal may apply a mask of its "
        "own, such as a per-key bias, which the paged op cannot apply)")


def base_model_name(model: Any) -> str | None:
    """The attribute of a causal LM holding its base model: ``"model"``, else its ``base_model_prefix``
    (``"transformer"``, ``"gpt_neox"``, ``"bert"``...); ``None`` when there is none."""
    for name in ("model", getattr(model, "base_model_prefix", None)):
        base = getattr(model, name, None) if isinstance(name, str) and name else None
        if base is not None and base is not model and callable(base) and hasattr(base, "modules"):
            return name
    return None


def base_model(model: Any) -> Any:
    """The base model of a causal LM (:func:`base_model_name`), or ``None``."""
    name = base_model_name(model)
    return getattr(model, name) if name else None


def output_head_names(model: Any) -> tuple[str, ...]:
    """The attributes of a causal LM holding the modules that turn the base model's hidden states into logits,
    applied in this order: the child (not the base model) that holds ``model.get_output_embeddings()``
    (``lm_head``; BERT's ``cls``: its transform and decoder; BioGPT's ``output_projection``), after the other
    children with weights registered before it (ELECTRA's ``generator_predictions``, then ``generator_lm_head``;
    ModernBERT's ``lm_head``, then ``decoder``); ``("lm_head",)`` when the model names no output embeddings;
    ``()`` when there is none. The numeric self-check confirms the guess."""
    out = getattr(model, "get_output_embeddings", lambda: None)()
    base = base_model(model)
    if out is None:
        return ("lm_head",) if getattr(model, "lm_head", None) is not None else ()
    names = []
    for name, child in model.named_children():
        if child is base or next(child.parameters(), None) is None:
            continue
        names.append(name)
        if any(m is out for m in child.modules()):
            return tuple(names)
    return ()


def _is_attention(module: Any) -> bool:
    """A module of transformers' attention kind (as :func:`piecegraph.hf.attention.attention_modules` finds), or a
    hand-written attention that wrapping makes one (:func:`piecegraph.hf.families.adaptable`: GPT-Neo's;
    :func:`is_projection_attention`: XGLM's, MVP's, TrOCR's)."""
    return (hasattr(module, "is_causal") and hasattr(module, "scaling") and getattr(module, "config", None) is not None
            ) or adaptable(module) or is_projection_attention(module)


_PROJECTION_FIELDS = ("num_heads", "head_dim", "embed_dim", "scaling", "layer_idx")


def is_projection_attention(module: Any) -> bool:
    """A hand-written self-attention of the fairseq layout (XGLM, MVP, TrOCR: softmax attention computed in the
    modeling code, not through transformers' attention interface): no config and no ``is_causal``, the
    projections ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj``, numbers ``num_heads``, ``head_dim``,
    ``embed_dim``, ``scaling`` (applied to the queries) and ``layer_idx``, and a forward taking
    ``key_value_states``. Wrapping makes it of transformers' kind
    (:func:`piecegraph.hf.attention.adapt_projection_attention`); the numeric self-check decides whether it runs."""
    if getattr(module, "config", None) is not None or hasattr(module, "is_causal"):
        return False
    if not all(hasattr(getattr(module, n, None), "weight") for n in ("q_proj", "k_proj", "v_proj", "out_proj")):
        return False
    numbers = [getattr(module, n, None) for n in _PROJECTION_FIELDS]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
        return False
    try:
        return "key_value_states" in inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False


def layer_attention(layer: Any) -> Any:
    """A decoder layer's self-attention module: its ``self_attn``, else the first causal module of transformers'
    attention kind inside it (``attn``, ``attention``, BERT's ``attention.self``; cross-attention, not causal, is
    passed over); ``None`` when it has none."""
    attn = getattr(layer, "self_attn", None)
    if attn is not None:
        return attn
    return next((m for m in layer.modules() if _is_attention(m) and getattr(m, "is_causal", True) is not False), None)


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers of a causal LM: the ``torch.nn.ModuleList`` of ``config.num_hidden_layers`` modules in
    its base model (``model.model.layers`` first), preferring one whose layers hold attention modules; ``[]``
    when it has none."""
    base = base_model(model)
    expected = decoder_field(model.config, "num_hidden_layers")
    if base is None or expected is None:
        return []
    first = getattr(base, "layers", None)
    lists = ([first] if first is not None and hasattr(first, "__len__") else []) + [
        m for m in base.modules() if type(m).__name__ == "ModuleList" and m is not first]
    lists = [list(m) for m in lists if len(m) == expected]
    with_attention = [layers for layers in lists if all(layer_attention(layer) is not None for layer in layers)]
    return (with_attention or lists or [[]])[0]


def decoder_field(config: Any, field: str, default: Any = None) -> Any:
    """``config.<field>`` (``num_attention_heads``, ``num_key_value_heads``, ``num_hidden_layers``) as a causal
    LM's decoder reads it. An encoder-decoder config used for its decoder alone (BART's, Whisper's, Blenderbot's
    ``*ForCausalLM``) maps these names to its encoder's fields (``attribute_map``: ``num_attention_heads`` ->
    ``encoder_attention_heads``), which its decoder never reads: there the decoder's twin
    (``decoder_attention_heads``) where the config has one."""
    target = getattr(type(config), "attribute_map", {}).get(field)
    if isinstance(target, str) and target.startswith("encoder_"):
        twin = getattr(config, "decoder_" + target[len("encoder_"):], None)
        if twin is not None:
            return twin
    return getattr(config, field, default)


def head_dim(config: Any) -> int:
    """``config.head_dim``, or ``hidden_size`` over the decoder's attention heads (:func:`decoder_field`) where it
    is missing or None."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // decoder_field(config,
                                                                                         "num_attention_heads"))


def head_dims(config: Any) -> tuple[int, int]:
    """``(query/key, value)`` head dims of the attention a Hugging Face model computes: ``qk_nope_head_dim +
    qk_rope_head_dim`` and ``v_head_dim`` where the config has them (multi-head latent attention run expanded,
    DeepSeek-V2/V3 and GLM-5, whose ``head_dim`` names the rotary part only), else :func:`head_dim` for both."""
    nope, rope = getattr(config, "qk_nope_head_dim", None), getattr(config, "qk_rope_head_dim", None)
    qk = int(nope + rope) if nope and rope else head_dim(config)
    return qk, int(getattr(config, "v_head_dim", None) or qk)


@dataclass(frozen=True)
class HFCacheShape(ModelConfig):
    """A :class:`ModelConfig` whose cached values have their own width, ``v_head_dim`` (a Hugging Face model whose
    value heads differ from its query/key heads); :func:`cache_config` returns one only then."""

    v_head_dim: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.v_head_dim, int) or isinstance(self.v_head_dim, bool) or self.v_head_dim <= 0:
            raise ValueError(f"HFCacheShape.v_head_dim must be a positive int, got {self.v_head_dim!r}")


def cache_config(config: Any, max_seq_len: int | None = None, attention_backend: str = "auto") -> ModelConfig:
    """The :class:`ModelConfig` a :class:`~piecegraph.attention.KVCache` (and ``generate``, the bench) needs.

    Only its cache shape is real: layers, kv heads (GQA: ``num_key_value_heads``, default the query heads),
    ``head_dim`` (and, where values are of another width, ``v_head_dim``: an :class:`HFCacheShape`; see
    :func:`head_dims`), vocabulary and hidden size. Norm epsilon, RoPE theta and biases stay with the Hugging Face
    model, which computes them itself (RoPE scaling included). ``max_seq_len`` defaults to
    ``max_position_embeddings`` capped at :data:`MAX_DEFAULT_CACHE_LEN`.
    """
    heads = decoder_field(config, "num_attention_heads")
    longest = max_seq_len or min(int(getattr(config, "max_position_embeddings", 2048) or 2048),
                                 MAX_DEFAULT_CACHE_LEN)
    qk, v = head_dims(config)
    shape = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=int(getattr(config, "intermediate_size", None) or config.hidden_size),
        num_layers=decoder_field(config, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=decoder_field(config, "num_key_value_heads") or heads, head_dim=qk,
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)), max_seq_len=longest,
        attention_backend=attention_backend,
    )
    return ModelConfig(**shape) if v == qk else HFCacheShape(**shape, v_head_dim=v)


def layer_constants(model: Any) -> list[dict[str, Any]]:
    """Per decoder layer, the attention constants its module holds: ``scale``, ``window``, ``softcap``.

    Read from the modules Hugging Face built (``self_attn.scaling``, ``.sliding_window``,
    ``.attn_logit_softcapping``), so a backend can be checked before the first step; the op receives the values
    the model passes at run time.
    """
    out = []
    for layer in decoder_layers(model):
        attn = layer_attention(layer)
        window = getattr(attn, "sliding_window", None)
        if window is None and model_type(model.config) in ("mistral", "mixtral"):
            window = getattr(model.config, "sliding_window", None)  # they pass the config's to attention
        out.append({"scale": float(attn.scaling), "window": window or None,
                    "softcap": getattr(attn, "attn_logit_softcapping", None)})
    return out
