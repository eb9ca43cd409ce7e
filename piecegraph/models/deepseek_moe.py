"""DeepSeek-style mixture of experts (DeepSeek-V2/V3, Kimi-K2, GLM-5): the router and the sparse MLP block.

The experts are :class:`~piecegraph.models.moe.Experts` (stacked SwiGLU weights, Hugging Face's
``gate_up_proj``/``down_proj`` layout; ``grouped_mm`` or ``gather``), so :func:`~piecegraph.models.quantize_fp8`
turns them into FP8 experts as it does for the Qwen2-MoE decoder. Routing is capacity-free and row-wise: each
row's choice reads only that row (the group-limited choice too), so pad rows never change a real row.
"""

from __future__ import annotations

import torch
from torch import nn

from piecegraph.models.decoder import MLP
from piecegraph.models.mla_config import MLAConfig
from piecegraph.models.moe import Experts


def keep_float32(module: nn.Module, *names: str) -> None:
    """Cast ``module``'s floating-point tensors ``names`` (parameters or buffers) back to float32 in place of
    their data, so a ``.to(dtype)`` of the whole model leaves them as transformers keeps them."""
    for name in names:
        t = getattr(module, name, None)
        if t is not None and t.is_floating_point() and t.dtype != torch.float32:
            t.data = t.data.float()


class DeepseekRouter(nn.Module):
    """``gate``: ``weight [E, H]`` and, for sigmoid routing, the ``e_score_correction_bias [E]`` buffer, both float32
    whatever the model's dtype (as transformers keeps them); logits in float32, as transformers computes them.

    ``softmax`` (DeepSeek-V2): probabilities over the experts; with groups, each group scored by its best expert,
    the ``topk_group`` best groups kept (others zeroed), then the ``top_k`` best; weights = those probabilities.
    ``sigmoid`` (V3, GLM-5): a sigmoid per expert, choice on ``score + e_score_correction_bias``; each group scored
    by the sum of its two best, the others masked out; weights = the chosen experts' scores without the bias,
    renormalised when ``norm_topk_prob``. Both then scale by ``routed_scaling_factor``.
    """

    def __init__(self, config: MLAConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.routing = config.num_experts, config.top_k, config.routing
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob, self.scale = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        if config.routing == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))
        else:
            self.e_score_correction_bias = None

    def _apply(self, fn, *args, **kwargs):  # type: ignore[override]
        # model.to(bfloat16) must not round the weight or the bias: transformers keeps both in float32, and they
        # decide which experts a token reaches
        super()._apply(fn, *args, **kwargs)
        keep_float32(self, "weight", "e_score_correction_bias")
        return self

    def _group_mask(self, choice: torch.Tensor) -> torch.Tensor:
        """``[T, E]`` bool: experts in the ``topk_group`` best groups of each row."""
        grouped = choice.view(choice.shape[0], self.n_group, -1)
        if self.routing == "sigmoid":
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        best = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, best, 1.0).bool()
        return mask.unsqueeze(-1).expand_as(grouped).reshape(choice.shape)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, top_k] float32, ids [T, top_k] int64)`` for ``x [T, H]``."""
        logits = nn.functional.linear(x.float(), self.weight.float())
        if self.routing == "softmax":
            scores = logits.softmax(dim=-1)
            if self.n_group > 1:
                scores = scores.masked_fill(~self._group_mask(scores), 0.0)
            weights, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        else:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            if self.n_group > 1:
                choice = choice.masked_fill(~self._group_mask(choice), float("-inf"))
            ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            if self.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class DeepseekMoE(nn.Module):
    """``gate`` (:class:`DeepseekRouter`), ``experts`` (:class:`~piecegraph.models.moe.Experts`) and, when
    ``num_shared_experts > 0``, ``shared_experts`` (one SwiGLU MLP of width ``num_shared_experts *
    expert_width``, added unscaled). ``forward(x [T, H]) -> [T, H]``, every row on its own.

    The routed weights are cast to ``x``'s dtype before the experts combine them (transformers multiplies the
    float32 weights into each expert's output in its dtype: equal in float32, within rounding in bf16).
    """

    def __init__(self, config: MLAConfig) -> None:
        super().__init__()
        self.gate = DeepseekRouter(config)
        self.experts = Experts(config)
        self.shared_experts = None
        if config.num_shared_experts:
            width = config.num_shared_experts * config.expert_width
            self.shared_experts = MLP(config.replace(intermediate_size=width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, ids, weights.to(x.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
