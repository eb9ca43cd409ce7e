"""FP8 (e4m3) weights for the reference decoders: :func:`quantize_fp8` turns a dense or MoE decoder's projections,
MLPs and experts into FP8 modules built from the same weights.

- Weights: e4m3 with one float32 scale per tensor (per expert for the stacked experts), so the weight's largest
  magnitude maps to 448. FlashInfer's 128x128 block-scaled GEMMs (``gemm_fp8_nt_groupwise``, its grouped form)
  refuse sm90 in FlashInfer 0.5.3, so block scales are not offered.
- Activations: quantized per row (per token) on the fly, in torch, so Inductor fuses the amax, divide and cast into
  the pieces around the GEMM. Per row, not per tensor: a per-tensor amax would mix pad rows into real rows' scales.
- GEMMs (``kernel``): ``"flashinfer"`` runs ``flashinfer.bmm_fp8`` (cuBLAS) for the linears and
  ``flashinfer.SegmentGEMMWrapper.run`` (CUTLASS grouped GEMM, sm90) for the experts, with unit scales, the row and
  weight scales applied after in torch; ``"torch"`` multiplies the same e4m3 values in float32 (CPU, and the
  reference). Nothing here is adapted by hand: piecegraph's automatic opaque wraps both FlashInfer entries. The
  experts have one more kernel, ``"scaled_grouped_mm"`` (per-channel weight scales, FP8 or bf16 per token count by
  measurement; the default on sm90): :mod:`piecegraph.models.fp8_grouped`.

Error bound (tested): with ``|dx| <= 2^-4 |x|`` and ``|dw| <= 2^-4 |w|`` elementwise (round to nearest, 3 mantissa
bits; plus half the subnormal step, ``2^-10`` of the scale), each output of an FP8 GEMM is within
``(2^-3 + 2^-8) * (|x| @ |w|^T)`` of the exact product, before the bf16 rounding of the result.
"""

from __future__ import annotations

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
KERNELS = ("flashinfer", "torch")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: each row of ``x [rows, k]`` scaled so its largest magnitude is 448 and cast to e4m3, and the
    float32 ``[rows]`` scales that undo it (``q.float() * scale[:, None] ~ x``). Row-wise only: pad rows never touch
    a real row's scale."""
    scale = x.abs().amax(-1).float().clamp(min=1e-12) / E4M3_MAX
    return (x.float() / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8), scale


def quantize_tensor(w: torch.Tensor, dims: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``w`` in e4m3 with one float32 scale over ``dims`` (default all: a 0-d scale), so each
    slice's largest magnitude maps to 448."""
    dims = tuple(range(w.dim())) if dims is None else dims
    scale = w.detach().abs().float().amax(dims, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    q = (w.detach().float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q, scale.squeeze() if scale.numel() == 1 else scale.reshape(-1)


def fp8_kernels_run(device: torch.device | str) -> bool:
    """Whether the ``"flashinfer"`` kernels can run on ``device``: CUDA with compute capability 9.x (the grouped
    GEMM's sm90 path; FlashInfer 0.5.3 has none for sm100 here) and FlashInfer importable."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


def _flashinfer():
    import flashinfer

    return flashinfer


class FP8Linear(nn.Module):
    """``y = x @ dequant(weight)^T + bias`` with ``x`` quantized per row: ``weight [out, in]`` e4m3 and its
    float32 ``weight_scale`` (0-d: one per tensor; ``[out]``: one per row, as a fused q/k/v or gate/up linear keeps
    each part's own scale on its rows) are buffers; output in ``out_dtype`` (the replaced layer's dtype).
    ``x [..., in]`` any leading shape. Built by :meth:`from_linear`; the float weights are not kept."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, kernel: str,
                 out_dtype: torch.dtype) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        self.kernel, self.out_dtype = kernel, out_dtype
        # Looked up once, here: the forward calls the library's function through this attribute (no import in
        # the traced code), and automatic opaque routes it there like any function a module holds
        self.bmm_fp8 = _flashinfer().bmm_fp8 if kernel == "flashinfer" else None
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale.float())
        self.register_buffer("unit", torch.ones(1, device=weight.device))  # bmm_fp8's scales: applied after
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernel: str) -> "FP8Linear":
        q, scale = quantize_tensor(linear.weight)
        return cls(q, scale, linear.bias, kernel, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        q, scale = quantize_rows(x.reshape(-1, self.in_features))
        if self.bmm_fp8 is not None:
            # bmm_fp8 wants B [1, in, out] column-major: the [out, in] weight transposed, a view
            y = self.bmm_fp8(q.unsqueeze(0), self.weight.t().unsqueeze(0), self.unit, self.unit, torch.bfloat16)[0]
        else:
            y = q.float() @ self.weight.float().t()
        y = (y.float() * (scale.unsqueeze(-1) * self.weight_scale)).to(self.out_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kernel={self.kernel}, e4m3 weight, " + (
            "per-tensor scale" if self.weight_scale.dim() == 0 else "per-row scale")
