"""FP8 experts and :func:`quantize_fp8`, which turns a reference decoder (dense or MoE) into its FP8 form.

:class:`FP8Experts` keeps :class:`~piecegraph.models.moe.Experts`' interface and routing contract: capacity-free,
each (token, expert) row computed on its own and summed back only into its own token, every quantization scale per
row; so pad rows never change a real row. Its rows are sorted by expert for the grouped GEMM (FlashInfer's
``SegmentGEMMWrapper.run`` on sm90, one object shared by every layer for its 128 MB workspace); like the bf16
``grouped_mm`` path it declares ``piecegraph_padding_safe = True``, so the token-mixing check skips that sort and
the group ends (tests/cpu/test_fp8.py appends pad rows and checks the real rows). The ``"torch"`` kernel gathers
each row's expert weights and multiplies the same e4m3 values in float32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from piecegraph.models.fp8 import KERNELS, FP8Linear, fp8_kernels_run, quantize_rows, quantize_tensor
from piecegraph.models.moe import Experts

WORKSPACE_BYTES = 128 << 20  # FlashInfer's advice for SegmentGEMMWrapper


class FP8Experts(nn.Module):
    """``E`` SwiGLU experts in e4m3: ``gate_up [E, 2W, H]`` and ``down [E, H, W]`` with ``[E]`` float32 scales
    (buffers). ``forward(x [T, H], ids [T, k], weights [T, k]) -> [T, H]`` in ``x``'s dtype, as
    :class:`~piecegraph.models.moe.Experts`. ``gemm``: the ``flashinfer.SegmentGEMMWrapper`` for
    ``kernel="flashinfer"`` (None for ``"torch"``)."""

    piecegraph_padding_safe = True  # the sort moves rows, never mixes them (module docstring)

    def __init__(self, experts: Experts, kernel: str, gemm: Any = None) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        if kernel == "flashinfer" and gemm is None:
            raise ValueError("kernel='flashinfer' needs the flashinfer.SegmentGEMMWrapper as gemm")
        self.kernel, self.gemm, self.width = kernel, gemm, experts.width
        self.num_experts = experts.gate_up_proj.shape[0]
        for name, weight in (("gate_up", experts.gate_up_proj), ("down", experts.down_proj)):
            q, scale = quantize_tensor(weight, dims=(1, 2))
            self.register_buffer(name, q)
            self.register_buffer(f"{name}_scale", scale)
        self.register_buffer("expert_ids", torch.arange(self.num_experts, device=experts.gate_up_proj.device))

    def _grouped(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, expert: torch.Tensor,
                 indptr: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert (``indptr`` their group ends) times their expert's weight, float32."""
        q, scale = quantize_rows(x)
        if self.kernel == "flashinfer":
            y = self.gemm.run(q, w, self.num_experts, True, seg_indptr=indptr, weight_indices=self.expert_ids)
        else:
            y = torch.bmm(w.index_select(0, expert).float(), q.float().unsqueeze(-1)).squeeze(-1)
        return y.float() * (scale * w_scale.index_select(0, expert)).unsqueeze(-1)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k = ids.shape[1]
        flat = ids.reshape(-1)  # pair p = t * k + j
        order = flat.argsort(stable=True)
        expert = flat.index_select(0, order)
        counts = (flat.unsqueeze(1) == self.expert_ids).sum(0)
        indptr = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        token = order // k
        gate_up = self._grouped(x.index_select(0, token), self.gate_up, self.gate_up_scale, expert, indptr)
        h = nn.functional.silu(gate_up[:, : self.width]) * gate_up[:, self.width:]
        y = self._grouped(h, self.down, self.down_scale, expert, indptr)
        y = y * weights.reshape(-1).index_select(0, order).float().unsqueeze(-1)
        return torch.zeros(x.shape, device=x.device).index_add(0, token, y).to(x.dtype)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, width={self.width}, kernel={self.kernel}, e4m3 per-expert weights"


# Linears quantized: attention projections, dense and shared-expert MLPs. The router (``gate``), the shared
# expert's gate, embeddings and ``lm_head`` stay in the model's dtype (routing must not flip on FP8 rounding).
_QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_fp8(model: nn.Module, kernel: str | None = None) -> nn.Module:
    """Replace ``model``'s projections, MLPs and experts, in place, by FP8 modules from the same weights (the
    float weights are dropped); returns ``model``. ``kernel``: ``"flashinfer"`` (CUDA sm90 with FlashInfer),
    ``"torch"`` (anywhere; float32 products of the e4m3 values), default the first that runs where the weights are.
    Quantize once, before compiling; a module quantized twice is refused."""
    device = next(model.parameters()).device
    kernel = kernel or ("flashinfer" if fp8_kernels_run(device) else "torch")
    if kernel == "flashinfer" and not fp8_kernels_run(device):
        raise ValueError(f"kernel='flashinfer' needs a CUDA sm90 device and FlashInfer; the weights are on {device}")
    if any(isinstance(m, (FP8Linear, FP8Experts)) for m in model.modules()):
        raise ValueError("the model is FP8 already: quantize_fp8 runs once, on the bf16/float32 model")
    gemm = None
    if kernel == "flashinfer" and any(isinstance(m, Experts) for m in model.modules()):
        import flashinfer

        gemm = flashinfer.SegmentGEMMWrapper(torch.empty(WORKSPACE_BYTES, dtype=torch.int8, device=device))
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Experts):
                setattr(parent, name, FP8Experts(child, kernel, gemm))
            elif isinstance(child, nn.Linear) and name in _QUANTIZED:
                setattr(parent, name, FP8Linear.from_linear(child, kernel))
    return model
