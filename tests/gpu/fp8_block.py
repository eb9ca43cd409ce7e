"""An FP8 block on FlashInfer's kernels: per layer rmsnorm -> per-tensor FP8 (e4m3) quantization in
torch -> bmm_fp8 -> silu_and_mul -> quantization -> bmm_fp8 -> residual. Nothing in it is prepared for
piecegraph: mode="auto" must find bmm_fp8 (which no adapter lists) and wrap it by itself. CUDA + FlashInfer only.
Used by test_auto_opaque_gpu.py and scripts/fp8_bench.py."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 (e4m3): the tensor scaled so its largest magnitude is 448, and the scale to undo it."""
    scale = x.abs().amax().float().clamp(min=1e-12) / 448.0
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8), scale.reshape(1)


def fp8_weight(k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[1, k, n]`` e4m3 weight, column-major as bmm_fp8 wants it (k contiguous), and its scale."""
    w = torch.randn(n, k, device="cuda") / k**0.5
    q, scale = quantize(w)
    return q.t().unsqueeze(0), scale


class Layer(torch.nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.norm = torch.nn.Parameter(torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5)
        up, up_scale = fp8_weight(hidden, 2 * inter)
        down, down_scale = fp8_weight(inter, hidden)
        for name, value in (("up", up), ("up_scale", up_scale), ("down", down), ("down_scale", down_scale)):
            self.register_buffer(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import flashinfer

        hq, hs = quantize(flashinfer.rmsnorm(x, self.norm))
        u = flashinfer.bmm_fp8(hq.unsqueeze(0), self.up, hs, self.up_scale, torch.bfloat16)[0]
        aq, a_scale = quantize(flashinfer.silu_and_mul(u))
        return x + flashinfer.bmm_fp8(aq.unsqueeze(0), self.down, a_scale, self.down_scale, torch.bfloat16)[0]


class Block(torch.nn.Module):
    def __init__(self, hidden: int = 1024, inter: int = 2048, layers: int = 4) -> None:
        super().__init__()
        self.hidden = hidden
        self.layers = torch.nn.ModuleList(Layer(hidden, inter) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x
