"""FP8 experts and :func:`quantize_fp8`, which turns a reference decoder (dense or MoE) into its FP8 form.

:class:`FP8Experts` keeps :class:`~piecegraph.models.moe.Experts`' interface and routing contract: capacity-free,
each (token, expert) row computed on its own and summed back only into its own token, every quantization scale per
row; so pad rows never change a real row. Its rows are sorted by expert for the grouped GEMM; like the bf16
``grouped_mm`` path it declares ``piecegraph_padding_safe = True``, so the token-mixing check skips that sort and
the group ends (tests/cpu/test_fp8.py appends pad rows and checks the real rows). Kernels (:data:`EXPERT_KERNELS`):

- ``"scaled_grouped_mm"`` (the default on sm90 where it runs): ``torch._scaled_grouped_mm`` with per-channel
  weight scales, or the model-dtype grouped GEMM, picked per token count by measurement
  (:mod:`piecegraph.models.fp8_grouped`);
- ``"flashinfer"``: FlashInfer's ``SegmentGEMMWrapper.run`` (sm90; one object shared by every layer for its 128 MB
  workspace), per-expert scales;
- ``"torch"``: each row's expert weights gathered, the same e4m3 values multiplied in float32 (the reference).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from piecegraph.models import fp8_grouped
from piecegraph.models.fp8 import KERNELS, FP8Linear, fp8_kernels_run, quantize_rows, quantize_tensor
from piecegraph.models.fuse import FUSED_GROUPS
from piecegraph.models.moe import Experts, grouped_mm_runs

WORKSPACE_BYTES = 128 << 20  # FlashInfer's advice for SegmentGEMMWrapper
EXPERT_KERNELS = ("scaled_grouped_mm", *KERNELS)


class FP8Experts(nn.Module):
    """``E`` SwiGLU experts in e4m3: ``gate_up [E, 2W, H]`` and ``down [E, H, W]`` (buffers) with float32 scales,
    ``[E]`` per expert, or ``[E, N]`` per output channel for ``"scaled_grouped_mm"``. ``forward(x [T, H], ids [T, k],
    weights [T, k]) -> [T, H]`` in ``x``'s dtype, as :class:`~piecegraph.models.moe.Experts`. ``gemm``: the
    ``flashinfer.SegmentGEMMWrapper`` for ``kernel="flashinfer"`` (None otherwise).

    ``"scaled_grouped_mm"`` also takes ``top_k`` (the router's k, for the measurement's inputs), ``max_tokens``
    (the largest token count measured) and ``timer`` (:data:`~piecegraph.models.fp8_grouped.Timer`; default: CUDA
    graph replays where ``torch._scaled_grouped_mm`` runs natively, else nothing is measured and FP8 runs at every
    size). The model-dtype weights are kept (``gate_up_dense``, ``down_dense``: the given experts' tensors, not
    copies) only if some size picks them. :meth:`kernel_table` and ``repr`` show the choice."""

    piecegraph_padding_safe = True  # the sort moves rows, never mixes them (module docstring)
    piecegraph_alternate_buffers = ("gate_up_dense", "down_dense")  # read instead of the FP8 ones at some sizes

    def __init__(self, experts: Experts, kernel: str, gemm: Any = None, *, top_k: int | None = None,
                 max_tokens: int = fp8_grouped.DEFAULT_MAX_TOKENS, timer: fp8_grouped.Timer | None = None) -> None:
        super().__init__()
        if kernel not in EXPERT_KERNELS:
            raise ValueError(f"kernel must be one of {EXPERT_KERNELS}, got {kernel!r}")
        if kernel == "flashinfer" and gemm is None:
            raise ValueError("kernel='flashinfer' needs the flashinfer.SegmentGEMMWrapper as gemm")
        self.kernel, self.gemm, self.width = kernel, gemm, experts.width
        self.num_experts = experts.gate_up_proj.shape[0]
        self.register_buffer("expert_ids", torch.arange(self.num_experts, device=experts.gate_up_proj.device))
        if kernel == "scaled_grouped_mm":
            self._build_grouped(experts, top_k, max_tokens, timer)
            return
        for name, weight in (("gate_up", experts.gate_up_proj), ("down", experts.down_proj)):
            q, scale = quantize_tensor(weight, dims=(1, 2))
            self.register_buffer(name, q)
            self.register_buffer(f"{name}_scale", scale)

    def _build_grouped(self, experts: Experts, top_k: int | None, max_tokens: int,
                       timer: fp8_grouped.Timer | None) -> None:
        if not top_k or top_k < 1:
            raise ValueError(f"kernel='scaled_grouped_mm' needs top_k (the router's k) >= 1, got {top_k!r}")
        device = experts.gate_up_proj.device
        self.native = fp8_grouped.scaled_grouped_mm_runs(device)
        if device.type == "cuda" and not self.native:
            raise ValueError(f"kernel='scaled_grouped_mm' needs torch._scaled_grouped_mm on a CUDA sm90 device; it "
                             f"does not run on {device}: use kernel='flashinfer' or 'torch'")
        e, n2, h = experts.gate_up_proj.shape
        if self.native and (h % 16 or n2 % 32):
            raise ValueError(f"kernel='scaled_grouped_mm' needs the hidden size ({h}) and expert width "
                             f"({n2 // 2}) multiples of 16; use kernel='flashinfer' or 'torch'")
        self.top_k, self.dtype = top_k, experts.gate_up_proj.dtype
        for name, weight in (("gate_up", experts.gate_up_proj), ("down", experts.down_proj)):
            q, scale = fp8_grouped.quantize_channels(weight)
            self.register_buffer(name, q)
            self.register_buffer(f"{name}_scale", scale)
            # a run-time fallback, not the FP8 model's state: left out of state_dict
            self.register_buffer(f"{name}_dense", weight.detach(), persistent=False)
        self.grouped = grouped_mm_runs(device, self.dtype)
        if timer is None and self.native:
            timer = fp8_grouped.cuda_graph_us
        key = ("experts", e, n2 // 2, h, top_k, self.dtype)  # what the layer's time depends on
        triton = self.native and fp8_grouped.triton_gemm_failure(str(self.gate_up.device)) is None
        self.table = fp8_grouped.measure_table(self._run, key, hidden=h, num_experts=e, top_k=top_k,
                                               dtype=self.dtype, device=device, max_tokens=max_tokens, timer=timer,
                                               triton=triton)
        self.sizes = [p.tokens for p in self.table]
        self.use_fp8 = [p.kernel != "dense" for p in self.table]
        self.use_triton = [p.kernel == "fp8-triton" for p in self.table]
        if all(self.use_fp8):  # the dense weights are never read: not kept
            self.gate_up_dense = self.down_dense = None

    def _apply(self, fn, *args, **kwargs):  # type: ignore[override]
        # .to(), .cuda(): the native and grouped choices follow the weights (decided here, eagerly, never under
        # a trace); the table stays the one measured where the module was built
        super()._apply(fn, *args, **kwargs)
        if self.kernel == "scaled_grouped_mm":
            self.native = fp8_grouped.scaled_grouped_mm_runs(self.gate_up.device)
            self.grouped = grouped_mm_runs(self.gate_up.device, self.dtype)
        return self

    def kernel_table(self) -> list[dict[str, Any]]:
        """The per-token-count choice of ``"scaled_grouped_mm"``: ``[{"tokens", "kernel" ("fp8" | "fp8-triton" |
        "dense"), "fp8_us", "dense_us", "triton_us"}]`` (times ``None`` where not measured); empty for the other
        kernels."""
        table = getattr(self, "table", ())
        return [{"tokens": p.tokens, "kernel": p.kernel, "fp8_us": p.fp8_us, "dense_us": p.dense_us,
                 "triton_us": p.triton_us} for p in table]

    def _grouped(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, expert: torch.Tensor,
                 indptr: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert (``indptr`` their group ends) times their expert's weight, float32."""
        q, scale = quantize_rows(x)
        if self.kernel == "flashinfer":
            y = self.gemm.run(q, w, self.num_experts, True, seg_indptr=indptr, weight_indices=self.expert_ids)
        else:
            y = torch.bmm(w.index_select(0, expert).float(), q.float().unsqueeze(-1)).squeeze(-1)
        return y.float() * (scale * w_scale.index_select(0, expert)).unsqueeze(-1)

    def _run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, sizes: list[int],
             use_fp8: list[bool], use_triton: list[bool]) -> torch.Tensor:
        """``"scaled_grouped_mm"``'s forward with the choice ``(sizes, use_fp8, use_triton)`` (see
        :func:`~piecegraph.models.fp8_grouped.picks_fp8`): sort, gather and combine traced, the experts' SwiGLU
        one opaque op. The combine is :class:`Experts`': each pair's output in ``x``'s dtype, weighted, summed."""
        tokens, k = ids.shape
        flat = ids.reshape(-1)  # pair p = t * k + j
        order = torch.argsort(flat, stable=True)
        expert = flat.index_select(0, order)
        ends = torch.searchsorted(expert, self.expert_ids, right=True).to(torch.int32)
        ys = fp8_grouped.grouped_experts(x.index_select(0, order // k), ends, expert, self.gate_up,
                                         self.gate_up_scale, self.down, self.down_scale, self.gate_up_dense,
                                         self.down_dense, self.width, k, sizes, use_fp8, use_triton, self.native,
                                         self.grouped)
        y = torch.empty_like(ys).index_copy(0, order, ys)
        return (y.view(tokens, k, -1) * weights.unsqueeze(-1)).sum(1)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.kernel == "scaled_grouped_mm":
            return self._run(x, ids, weights, self.sizes, self.use_fp8, self.use_triton)
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
        head = f"experts={self.num_experts}, width={self.width}, kernel={self.kernel}"
        if self.kernel != "scaled_grouped_mm":
            return head + ", e4m3 per-expert weights"
        rows = ", ".join(f"{p.tokens}: {p.kernel}" + ("" if p.fp8_us is None else f" ({p.fp8_us:g} vs "
                                                       + ("" if p.triton_us is None else f"{p.triton_us:g} vs ")
                                                       + f"{p.dense_us:g} us)") for p in self.table)
        dense = "kept" if self.gate_up_dense is not None else "dropped"
        return (f"{head}, e4m3 per-channel weights, {self.dtype} weights {dense}, "
                f"{'native' if self.native else 'float32'} FP8 GEMM; by tokens: {rows}")


# Linears quantized: attention projections, dense and shared-expert MLPs. The router (``gate``), the shared
# expert's gate, embeddings and ``lm_head`` stay in the model's dtype (routing must not flip on FP8 rounding).
_QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
              "gate_up_proj")
# fuse_projections' fused linears: the parent's attribute holding their parts' sizes (rows)
_FUSED_SIZES = {fused_name: sizes_name for _, _, fused_name, sizes_name, _ in FUSED_GROUPS}


def _fp8_linear(parent: nn.Module, name: str, linear: nn.Linear, kernel: str) -> FP8Linear:
    """``linear`` in e4m3; a fused one with one scale per part (a ``[out]`` row scale, each part's value on its
    rows), so its e4m3 weights and scales equal those of the unfused parts quantized one by one."""
    sizes = getattr(parent, _FUSED_SIZES[name], None) if name in _FUSED_SIZES else None
    if sizes is None:
        return FP8Linear.from_linear(linear, kernel)
    parts = [quantize_tensor(w) for w in linear.weight.split(sizes)]
    scale = torch.cat([s.expand(n) for (_, s), n in zip(parts, sizes)])
    return FP8Linear(torch.cat([q for q, _ in parts]), scale, linear.bias, kernel, linear.weight.dtype)


def _router_top_k(parent: nn.Module) -> int | None:
    """The k of the router beside an ``experts`` child: ``SparseMoeBlock.top_k`` or ``DeepseekMoE.gate.top_k``."""
    return getattr(parent, "top_k", None) or getattr(getattr(parent, "gate", None), "top_k", None)


def _default_expert_kernel(model: nn.Module, device: torch.device, linear_kernel: str) -> str:
    """``"scaled_grouped_mm"`` where it runs natively and fits every MoE block (a known top_k, widths multiples of
    16), else the linears' kernel."""
    if not fp8_grouped.scaled_grouped_mm_runs(device):
        return linear_kernel
    for parent in model.modules():
        experts = getattr(parent, "experts", None)
        if isinstance(experts, Experts):
            _, n2, h = experts.gate_up_proj.shape
            if not _router_top_k(parent) or h % 16 or n2 % 32:
                return linear_kernel
    return "scaled_grouped_mm"


def quantize_fp8(model: nn.Module, kernel: str | None = None, *, expert_kernel: str | None = None,
                 max_tokens: int = fp8_grouped.DEFAULT_MAX_TOKENS, timer: fp8_grouped.Timer | None = None
                 ) -> nn.Module:
    """Replace ``model``'s projections, MLPs and experts, in place, by FP8 modules from the same weights (the
    float weights are dropped, but for experts whose measured choice keeps them); returns ``model``.

    ``kernel``: ``"flashinfer"`` (CUDA sm90 with FlashInfer), ``"torch"`` (anywhere; float32 products of the e4m3
    values), default the first that runs where the weights are. ``expert_kernel``: one of :data:`EXPERT_KERNELS`;
    default ``kernel`` when given, else ``"scaled_grouped_mm"`` on sm90 where ``torch._scaled_grouped_mm`` runs
    (FP8 or the model-dtype experts per token count, measured here up to ``max_tokens`` tokens, once per layer
    shape; ``timer`` replaces the measurement), else the linears' kernel. Quantize once, before compiling, on the
    device that will run the model; a module quantized twice is refused."""
    device = next(model.parameters()).device
    if kernel == "scaled_grouped_mm":  # an experts-only kernel: the linears take their default
        expert_kernel, kernel = expert_kernel or kernel, None
    explicit = kernel
    kernel = kernel or ("flashinfer" if fp8_kernels_run(device) else "torch")
    expert_kernel = expert_kernel or explicit or _default_expert_kernel(model, device, kernel)
    for name, value in (("kernel", kernel), ("expert_kernel", expert_kernel)):
        if value == "flashinfer" and not fp8_kernels_run(device):
            raise ValueError(f"{name}='flashinfer' needs a CUDA sm90 device and FlashInfer; the weights are on "
                             f"{device}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if any(isinstance(m, (FP8Linear, FP8Experts)) for m in model.modules()):
        raise ValueError("the model is FP8 already: quantize_fp8 runs once, on the bf16/float32 model")
    gemm = None
    if expert_kernel == "flashinfer" and any(isinstance(m, Experts) for m in model.modules()):
        import flashinfer

        gemm = flashinfer.SegmentGEMMWrapper(torch.empty(WORKSPACE_BYTES, dtype=torch.int8, device=device))
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Experts):
                setattr(parent, name, FP8Experts(child, expert_kernel, gemm, top_k=_router_top_k(parent),
                                                 max_tokens=max_tokens, timer=timer))
            elif isinstance(child, nn.Linear) and name in _QUANTIZED:
                setattr(parent, name, _fp8_linear(parent, name, child, kernel))
    return model
