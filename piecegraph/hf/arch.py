"""What a Hugging Face model must be for piecegraph to run it, and the cache shape read from its config.

Support is decided by evidence, never by ``model_type``: :func:`check_supported` reads the config (what it
declares: encoder-decoder, multimodal, layer kinds, attention options), :func:`check_structure` the built model
(a causal LM whose decoder layers and attention modules are where the flat forward reaches them), and
:func:`piecegraph.hf.probe.verify` runs it (each layer's attention through the interface, numbers equal).
Everything here reads attributes only; nothing imports transformers.
"""

from __future__ import annotations

from typing import Any

from piecegraph.models.config import ModelConfig

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
    """
    name = model_type(config)
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
        raise UnsupportedModelError(
            f"model_type {name!r}: config.layer_types names {kinds}, layers that are not softmax attention over "
            "a KV cache (recurrent, linear-attention, convolutional or chunked layers); piecegraph's paged "
            "attention runs full and sliding-window attention only")
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
    if experts_impl == "eager":
        raise UnsupportedModelError(
            f"model_type {name!r}: its experts run with experts_implementation='eager', a Python loop over the "
            "experts each batch hits, which Dynamo cannot trace as one graph. Load it with "
            "experts_implementation='batched_mm' (or 'grouped_mm'), e.g. "
            "AutoModelForCausalLM.from_pretrained(path, experts_implementation='batched_mm')."
        )


def _text_config(config: Any) -> Any:
    """The text sub-config of a multimodal config (``text_config`` beside a vision or audio one), else None."""
    text = getattr(config, "text_config", None)
    return text if text is not None and text is not config else None


def check_structure(model: Any) -> None:
    """Raise :class:`UnsupportedModelError` (``TypeError`` for a base model without an output head) when
    ``model`` is not built the way piecegraph's flat forward relies on: a causal LM with a base model
    (``model.model``) whose decoder layers are one ``torch.nn.ModuleList`` of ``num_hidden_layers`` layers
    and an output head (``lm_head``). Whether
    each layer's attention goes through transformers' attention interface (by its config's
    ``_attn_implementation``) exactly once, and the whole computes what the model computes, is the run-time
    evidence of :func:`piecegraph.hf.probe.verify` (transformers' own class flag,
    ``_supports_attention_backend``, is not used: it also marks models whose layers reach the interface but
    drop its keyword arguments, which piecegraph runs)."""
    name = model_type(model.config)
    if not hasattr(model, "lm_head") and getattr(model, "get_output_embeddings", lambda: None)() is None:
        raise TypeError(f"{type(model).__name__} ({name!r}) is not a *ForCausalLM with .model and .lm_head: pass "
                        "the causal LM (AutoModelForCausalLM), not its base model")
    if getattr(model, "model", None) is None or not hasattr(model, "lm_head"):
        where = ("its output head is not model.lm_head" if getattr(model, "model", None) is not None else
                 f"its base model is model.{getattr(model, 'base_model_prefix', '') or '?'}, not model.model")
        raise UnsupportedModelError(f"model_type {name!r}: {type(model).__name__} is laid out otherwise ({where}); "
                                    "piecegraph.hf runs causal LMs laid out as model.model (decoder layers at "
                                    "model.model.layers) and model.lm_head")
    layers = decoder_layers(model)
    if not layers:
        raise UnsupportedModelError(f"model_type {name!r}: its base model {type(model.model).__name__} has no "
                                    f"list of {model.config.num_hidden_layers} decoder layers (model.model.layers)")
    plain = [i for i, layer in enumerate(layers) if getattr(layer, "self_attn", None) is None]
    if plain:
        raise UnsupportedModelError(f"model_type {name!r}: decoder layers {plain} ({type(layers[plain[0]]).__name__}) "
                                    "have no self_attn attention module (a recurrent, convolutional or otherwise "
                                    "organised layer)")


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers of a causal LM (``model.model.layers``), or ``[]`` when it has no such list of
    ``config.num_hidden_layers`` modules."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    expected = getattr(model.config, "num_hidden_layers", None)
    if layers is None or not hasattr(layers, "__len__") or (expected is not None and len(layers) != expected):
        return []
    return list(layers)


def head_dim(config: Any) -> int:
    """``config.head_dim``, or ``hidden_size // num_attention_heads`` where it is missing or None."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def cache_config(config: Any, max_seq_len: int | None = None, attention_backend: str = "auto") -> ModelConfig:
    """The :class:`ModelConfig` a :class:`~piecegraph.attention.KVCache` (and ``generate``, the bench) needs.

    Only its cache shape is real: layers, kv heads (GQA: ``num_key_value_heads``, default the query heads),
    ``head_dim``, vocabulary and hidden size. Norm epsilon, RoPE theta and biases stay with the Hugging Face
    model, which computes them itself (RoPE scaling included). ``max_seq_len`` defaults to
    ``max_position_embeddings`` capped at :data:`MAX_DEFAULT_CACHE_LEN`.
    """
    heads = config.num_attention_heads
    longest = max_seq_len or min(int(getattr(config, "max_position_embeddings", 2048) or 2048),
                                 MAX_DEFAULT_CACHE_LEN)
    return ModelConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=int(getattr(config, "intermediate_size", None) or config.hidden_size),
        num_layers=config.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim(config),
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)), max_seq_len=longest,
        attention_backend=attention_backend,
    )


def layer_constants(model: Any) -> list[dict[str, Any]]:
    """Per decoder layer, the attention constants its module holds: ``scale``, ``window``, ``softcap``.

    Read from the modules Hugging Face built (``self_attn.scaling``, ``.sliding_window``,
    ``.attn_logit_softcapping``), so a backend can be checked before the first step; the op receives the values
    the model passes at run time.
    """
    out = []
    for layer in model.model.layers:
        attn = layer.self_attn
        window = getattr(attn, "sliding_window", None)
        if window is None and model_type(model.config) in ("mistral", "mixtral"):
            window = getattr(model.config, "sliding_window", None)  # they pass the config's to attention
        out.append({"scale": float(attn.scaling), "window": window or None,
                    "softcap": getattr(attn, "attn_logit_softcapping", None)})
    return out
