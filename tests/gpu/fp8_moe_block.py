"""An FP8 mixture-of-experts block on FlashInfer's grouped GEMM for sm90: per layer an RMSNorm, top-k softmax
routing in torch, the (token, expert) rows sorted by expert, per-token FP8 (e4m3) quantization in torch,
``SegmentGEMMWrapper.run`` (FlashInfer's CUTLASS grouped GEMM, e4m3 in, bf16 out) for the gate/up projection,
SwiGLU, quantization again, the down projection, and the rows scaled by their activation scale, their expert's
weight scale and routing weight and summed back per token; a residual.

Nothing in it is prepared for piecegraph: the model holds one ``SegmentGEMMWrapper`` object and calls its ``run``
method, whose JIT loader stops Dynamo; mode="auto" must wrap that method by itself. The routing is capacity-free
and every quantization scale is per row, so pad rows never change a real row's experts or output (the sort only
moves where rows sit in the grouped GEMM: compile with ``token_mixing="pad"``). FlashInfer's
``cutlass_fused_moe`` is not used: its sm90 JIT build compiles the whole TensorRT-LLM MoE GEMM family (dozens of
CUTLASS translation units) and takes longer than a test run can wait. CUDA (sm90) + FlashInfer only; used by
test_fp8_moe_gpu.py and scripts/fp8_bench.py (``moe``).
"""

from __future__ import annotations

import torch

from piecegraph.models.fp8 import quantize_rows, quantize_tensor  # torch only: the decoders' own e4m3 helpers


def fp8_experts(experts: int, out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, out, in]`` e4m3 weights (column-major for the grouped GEMM: ``in`` contiguous) and ``[E]`` scales."""
    return quantize_tensor(torch.randn(experts, out, inp, device="cuda") / inp**0.5, dims=(1, 2))


class MoELayer(torch.nn.Module):
    def __init__(self, gemm, hidden: int, width: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.gemm, self.width, self.experts, self.top_k = gemm, width, experts, top_k
        self.norm = torch.nn.Parameter(torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5)
        self.router = torch.nn.Parameter(torch.randn(hidden, experts, device="cuda") / hidden**0.5)
        up, up_scale = fp8_experts(experts, 2 * width, hidden)
        down, down_scale = fp8_experts(experts, hidden, width)
        for name, value in (("up", up), ("up_scale", up_scale), ("down", down), ("down_scale", down_scale),
                            ("expert_ids", torch.arange(experts, device="cuda"))):
            self.register_buffer(name, value)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rows' token, rows' expert, rows' routing weight, segment indptr [E + 1])`` with rows sorted by
        expert (stable): each token's ``top_k`` (token, expert) pairs."""
        weight, expert = torch.softmax(h.float() @ self.router, -1).topk(self.top_k, -1)
        flat = expert.reshape(-1)
        order = flat.argsort(stable=True)
        counts = (flat.unsqueeze(1) == self.expert_ids).sum(0)
        indptr = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        return order // self.top_k, flat.index_select(0, order), weight.reshape(-1).index_select(0, order), indptr

    def grouped(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, expert: torch.Tensor,
                indptr: torch.Tensor) -> torch.Tensor:
        q, scale = quantize_rows(x)
        y = self.gemm.run(q, w, self.experts, True, seg_indptr=indptr, weight_indices=self.expert_ids)
        return y.float() * (scale * w_scale.index_select(0, expert)).unsqueeze(-1)

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.normed(x)
        token, expert, weight, indptr = self.route(h)
        u = self.grouped(h.index_select(0, token), self.up, self.up_scale, expert, indptr)
        a = torch.nn.functional.silu(u[:, : self.width]) * u[:, self.width:]
        y = self.grouped(a, self.down, self.down_scale, expert, indptr) * weight.unsqueeze(-1)
        return x + torch.zeros(x.shape, device=x.device).index_add(0, token, y).to(x.dtype)

    def dequantized(self, x: torch.Tensor) -> torch.Tensor:
        """The same layer (same norm and routing) in float32 with the weights dequantized and the activations not
        quantized: the reference the FP8 error is measured against."""
        h = self.normed(x)
        token, expert, weight, _ = self.route(h)
        h, x = h.float(), x.float()
        up = self.up.float() * self.up_scale[:, None, None]
        down = self.down.float() * self.down_scale[:, None, None]
        rows = h.index_select(0, token)
        u = torch.einsum("rk,rnk->rn", rows, up.index_select(0, expert))
        a = torch.nn.functional.silu(u[:, : self.width]) * u[:, self.width:]
        y = torch.einsum("rk,rnk->rn", a, down.index_select(0, expert)) * weight.unsqueeze(-1)
        return x + torch.zeros_like(x).index_add(0, token, y)


class MoEBlock(torch.nn.Module):
    """``layers`` FP8 MoE layers sharing one ``flashinfer.SegmentGEMMWrapper`` (its 128 MB workspace)."""

    def __init__(self, hidden: int = 1024, width: int = 512, experts: int = 16, top_k: int = 4,
                 layers: int = 4) -> None:
        import flashinfer

        super().__init__()
        self.hidden = hidden
        gemm = flashinfer.SegmentGEMMWrapper(torch.empty(128 << 20, dtype=torch.int8, device="cuda"))
        self.layers = torch.nn.ModuleList(MoELayer(gemm, hidden, width, experts, top_k) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

