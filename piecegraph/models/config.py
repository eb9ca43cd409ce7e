"""The reference decoder's shape: one frozen dataclass, presets, and a reader for Hugging Face config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from piecegraph.attention.types import ATTENTION_BACKENDS

_SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
_MAX_DEFAULT_CACHE_LEN = 4096


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Qwen2/Llama-family decoder.

    Constraints (checked in ``__post_init__``; each error names the field): every size is a positive int,
    ``num_heads`` is a multiple of ``num_kv_heads`` (grouped-query attention), ``head_dim`` is even (RoPE
    rotates pairs of halves), ``rms_eps`` and ``rope_theta`` are positive. ``max_seq_len`` is only the default
    longest sequence of a :class:`~piecegraph.attention.kv_cache.KVCache`. ``attention_backend`` picks the attention
    kernels: ``"torch"`` (vectorized SDPA, any device), ``"flashinfer"`` (CUDA), ``"auto"`` (FlashInfer when it
    imports and the cache is on CUDA, else torch).

    Example: ``ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16)``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    qkv_bias: bool = False
    max_seq_len: int = 2048
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_seq_len"):
            value = getattr(self, name)
            # bool is an int subclass; True as a size is always a mistake.
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        for name in ("rms_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"ModelConfig.{name} must be a positive number, got {value!r}")
        for name in ("tie_embeddings", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"ModelConfig.num_kv_heads ({self.num_kv_heads}) for grouped-query attention"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"ModelConfig.attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for rotary embeddings, got {self.head_dim}")

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], max_seq_len: int | None = None) -> "ModelConfig":
        """Read a Hugging Face ``config.json`` dict of a Qwen2 or Llama model.

        Qwen2 always has q/k/v biases; Llama has them only when ``attention_bias`` is true. ``head_dim`` defaults
        to ``hidden_size // num_attention_heads`` and ``num_key_value_heads`` to ``num_attention_heads``.
        ``max_seq_len`` (only the KV cache's default length) defaults to ``max_position_embeddings`` capped at
        ``_MAX_DEFAULT_CACHE_LEN``: a 32k default would make every cache, and the decode path's gather, huge.
        RoPE theta is read from ``rope_parameters`` (where transformers 5 writes it) or the top-level
        ``rope_theta`` (older files). Raises ``ValueError`` naming the missing key, an unsupported ``model_type``,
        or a feature the reference decoder does not compute (RoPE scaling such as ``llama3`` or ``yarn``, MLP
        biases, another activation, an active sliding window): such checkpoints run with ``piecegraph.hf.load``.
        """
        model_type = hf.get("model_type", "qwen2")
        if model_type not in _SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json model_type {model_type!r} is not supported; expected one of {_SUPPORTED_MODEL_TYPES}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in hf:
                raise ValueError(f"config.json lacks required key {key!r} (model_type {model_type!r})")
        _refuse_unsupported(hf, model_type)
        heads = hf["num_attention_heads"]
        qkv_bias = True if model_type == "qwen2" else bool(hf.get("attention_bias", False))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(hf),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            max_seq_len=max_seq_len or min(int(hf.get("max_position_embeddings", 2048)), _MAX_DEFAULT_CACHE_LEN),
        )

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` dict describing this shape (what :func:`save_hf` writes).

        Qwen2 when ``qkv_bias`` (Qwen2 always has q/k/v biases), else Llama with ``attention_bias: false``, so
        that :meth:`from_hf` and Hugging Face both read the shape back unchanged.
        """
        arch, model_type = ("Qwen2ForCausalLM", "qwen2") if self.qkv_bias else ("LlamaForCausalLM", "llama")
        return {
            "architectures": [arch],
            "model_type": model_type,
            "attention_bias": self.qkv_bias,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,  # transformers < 5 reads this one, 5 reads rope_parameters
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_seq_len,
            "hidden_act": "silu",
        }


def _rope_parameters(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """RoPE settings: transformers 5's ``rope_parameters``, else the older ``rope_scaling`` (may be None)."""
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def _rope_theta(hf: Mapping[str, Any]) -> float:
    theta = _rope_parameters(hf).get("rope_theta")
    return float(theta if theta is not None else hf.get("rope_theta", 10000.0))


def _refuse_unsupported(hf: Mapping[str, Any], model_type: str) -> None:
    """Raise ``ValueError`` for a config.json whose model the reference decoder would compute wrong."""
    rope = _rope_parameters(hf)
    if any(isinstance(v, Mapping) for v in rope.values()):
        raise ValueError(f"config.json ({model_type}) has per-layer-type rope_parameters {sorted(rope)}; the "
                         "reference decoder has one RoPE: load it with piecegraph.hf.load")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    problems = []
    if rope_type not in (None, "default"):
        problems.append(f"RoPE scaling rope_type={rope_type!r}")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias=true")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r}")
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        problems.append(f"a sliding window of {hf['sliding_window']}")
    if problems:
        raise ValueError(f"config.json ({model_type}) has {', '.join(problems)}, which the reference decoder does "
                         "not compute; load it with piecegraph.hf.load (Hugging Face's own layers) instead")


TINY = ModelConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, qkv_bias=True, tie_embeddings=True, max_seq_len=256,
)

QWEN2_5_0_5B = ModelConfig(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
    head_dim=64, rms_eps=1e-6, rope_theta=1e6, tie_embeddings=True, qkv_bias=True, max_seq_len=4096,
)

# Llama-2-7B's dimensions with 8 kv heads (GQA, as Llama 3 and Mistral): the shape that benefits from tensor
# parallelism in the benchmarks (13.5 GB of bf16 weights). Random weights only: it names no checkpoint.
# Llama-3.2-1B's shape (its llama3 RoPE scaling aside: random weights, plain RoPE), the batch-1 memory-bound case.
LLAMA_3_2_1B_SHAPE = ModelConfig(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
    head_dim=64, rms_eps=1e-5, rope_theta=5e5, tie_embeddings=True, qkv_bias=False, max_seq_len=4096,
)

LLAMA_7B_SHAPE = ModelConfig(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=8,
    head_dim=128, rms_eps=1e-5, rope_theta=1e4, tie_embeddings=False, qkv_bias=False, max_seq_len=4096,
)
