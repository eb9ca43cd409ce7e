"""Which Hugging Face decoders piecegraph runs, what it refuses, and the cache shape read from their configs.

Everything here reads a ``transformers`` config object (attribute access only); nothing imports transformers.
"""

from __future__ import annotations

from typing import Any

from piecegraph.models.config import ModelConfig

# model_type -> the family, for messages. Each was tested against Hugging Face's own forward and generate.
SUPPORTED = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gemma": "Gemma",
    "gemma2": "Gemma 2 (sliding window, logit softcaps: torch attention backend only)",
    "gemma3_text": "Gemma 3 text (sliding window: torch attention backend only)",
    "qwen2_moe": "Qwen2-MoE",
    "mixtral": "Mixtral",
}
# Config fields that change attention in ways the split op does not implement: (field, why), refused when set.
_REFUSED_FIELDS = (
    ("use_bidirectional_attention", "bidirectional (non-causal) attention"),
    ("attention_chunk_size", "chunked local attention"),
)
MAX_DEFAULT_CACHE_LEN = 4096  # as ModelConfig.from_hf: a 128k default would make every cache huge


class UnsupportedModelError(ValueError):
    """A Hugging Face model piecegraph cannot run exactly; the message names its model_type and the reason."""


def model_type(config: Any) -> str:
    return str(getattr(config, "model_type", "") or type(config).__name__)


def check_supported(config: Any, experts_impl: str | None = None) -> None:
    """Raise :class:`UnsupportedModelError` naming ``config.model_type`` when piecegraph cannot run it exactly.

    Refused: model types outside :data:`SUPPORTED` (encoders, multimodal wrappers, recurrent or hybrid models),
    non-causal or chunked attention, attention dropout in training (callers put the model in eval mode), and a
    mixture-of-experts layer whose experts implementation is ``"eager"`` (a Python loop over the experts a batch
    hits: data-dependent, so Dynamo cannot trace it whole; ``grouped_mm`` or ``batched_mm`` can).
    """
    name = model_type(config)
    if name not in SUPPORTED:
        raise UnsupportedModelError(
            f"Hugging Face model_type {name!r} is not supported by piecegraph.hf (supported: "
            f"{', '.join(sorted(SUPPORTED))}). Its attention may differ from causal paged attention (an encoder, "
            "a multimodal wrapper, a recurrent or hybrid layer); run it with its own forward instead."
        )
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
