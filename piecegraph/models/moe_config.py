"""The reference mixture-of-experts decoder's shape: :class:`MoEConfig` (a :class:`ModelConfig` plus experts),
presets, and parameter counts computed from the config alone (nothing allocated)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from piecegraph.models.config import ModelConfig

ROUTINGS = ("softmax", "sigmoid")
EXPERT_IMPLS = ("auto", "grouped_mm", "gather")


@dataclass(frozen=True)
class MoEConfig(ModelConfig):
    """Shape of a Qwen2-MoE-style decoder: the dense decoder's attention, and in every layer a sparse MLP of
    ``num_experts`` SwiGLU experts of width ``expert_width``, ``top_k`` of them per token, plus an optional shared
    expert of width ``shared_expert_width`` (``0``: none) scaled by ``sigmoid(shared_expert_gate(x))``.

    ``routing``: ``"softmax"`` (probabilities over all experts, then top-k, as Qwen2-MoE and Mixtral) or
    ``"sigmoid"`` (an independent sigmoid score per expert, then top-k, as DeepSeek-V3 without its bias
    correction or expert groups). ``norm_topk_prob`` renormalises the chosen ``top_k`` weights to sum to one.
    Routing is capacity-free: no token is ever dropped, so pad rows cannot displace real ones.
    ``expert_impl``: ``"grouped_mm"`` (pairs sorted by expert, ``torch._grouped_mm``; bf16 only, as its meta in
    torch 2.13 requires), ``"gather"`` (each (token, expert) pair gathers its expert's weights and runs ``bmm``:
    any dtype and device, every op row-wise, but it materialises ``T * top_k`` weight copies: tiny presets and
    float64 checks only) or ``"auto"`` (``grouped_mm`` where it runs on the weights' device and dtype, else
    ``gather``). ``intermediate_size`` is Hugging Face's dense MLP width, unused here (every layer is sparse).

    The MoE fields are keyword-only. Constraints (``__post_init__``; each error names the field): the
    :class:`ModelConfig` ones, positive ints ``num_experts``, ``top_k <= num_experts``, ``expert_width``; an int
    ``shared_expert_width >= 0``; a bool ``norm_topk_prob``; ``routing`` in :data:`ROUTINGS`; ``expert_impl`` in
    :data:`EXPERT_IMPLS`.

    Example: ``TINY_MOE.replace(routing="sigmoid", norm_topk_prob=True)``.
    """

    num_experts: int = field(kw_only=True)
    top_k: int = field(kw_only=True)
    expert_width: int = field(kw_only=True)
    shared_expert_width: int = field(default=0, kw_only=True)
    norm_topk_prob: bool = field(default=False, kw_only=True)
    routing: str = field(default="softmax", kw_only=True)
    expert_impl: str = field(default="auto", kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_experts", "top_k", "expert_width", "shared_expert_width"):
            value = getattr(self, name)
            low = 0 if name == "shared_expert_width" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                kind = "a non-negative int (0: no shared expert)" if low == 0 else "a positive int"
                raise ValueError(f"MoEConfig.{name} must be {kind}, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k ({self.top_k}) must be at most MoEConfig.num_experts "
                             f"({self.num_experts})")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"MoEConfig.norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"MoEConfig.routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.expert_impl not in EXPERT_IMPLS:
            raise ValueError(f"MoEConfig.expert_impl must be one of {EXPERT_IMPLS}, got {self.expert_impl!r}")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], max_seq_len: int | None = None) -> "MoEConfig":
        raise NotImplementedError("MoEConfig.from_hf: loading MoE checkpoints is not implemented yet; build the "
                                  "config by hand (see QWEN1_5_MOE_A2_7B)")

    def to_hf(self) -> dict[str, Any]:
        raise NotImplementedError("MoEConfig.to_hf: saving MoE checkpoints is not implemented yet (the dense "
                                  "ModelConfig.to_hf would describe a different model)")

    def parameter_counts(self) -> tuple[int, int]:
        """``(total, active)``: every parameter of :class:`~piecegraph.models.moe.MoEDecoder` of this shape, and
        those one token uses (its ``top_k`` experts, not the other experts), computed without allocating."""
        h, e, w = self.hidden_size, self.num_experts, self.expert_width
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0)
        shared = 3 * h * self.shared_expert_width + h if self.shared_expert_width else 0
        dense_per_layer = attention + e * h + shared + 2 * h  # + router + shared expert (+ gate) + 2 norms
        expert = 3 * h * w
        embeddings = self.vocab_size * h * (1 if self.tie_embeddings else 2) + h  # + final norm
        total = embeddings + self.num_layers * (dense_per_layer + e * expert)
        active = embeddings + self.num_layers * (dense_per_layer + self.top_k * expert)
        return total, active


# Qwen1.5-MoE-A2.7B's shape (Hugging Face config.json of Qwen/Qwen1.5-MoE-A2.7B): 14.3B parameters, 2.7B active.
# Random weights only here: loading the checkpoint is not implemented yet.
QWEN1_5_MOE_A2_7B = MoEConfig(
    vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_layers=24, num_heads=16, num_kv_heads=16,
    head_dim=128, rms_eps=1e-6, rope_theta=1e6, tie_embeddings=False, qkv_bias=True, max_seq_len=4096,
    num_experts=60, top_k=4, expert_width=1408, shared_expert_width=5632, norm_topk_prob=False,
)

# For CPU tests: 8 experts, top-2, a shared expert, untied.
TINY_MOE = MoEConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, qkv_bias=True, tie_embeddings=False, max_seq_len=256,
    num_experts=8, top_k=2, expert_width=32, shared_expert_width=48,
)
