"""Linears that keep a checkpoint's FP8 weights: block-scaled (:class:`FP8BlockLinear`, DeepSeek / Qwen3-FP8's
128x128 ``weight_scale_inv``) and per-channel (:class:`FP8ChannelLinear`, compressed-tensors' ``weight_scale``).

Activations are quantized on the fly, per token: in groups of ``block_k`` (1 x 128) for block weights, per row
for channel weights; in torch, so Inductor fuses the amax, divide and cast into the pieces around the GEMM. Per
token, so a pad row never changes a real row's scale.

Block-scaled GEMM kernels (``kernel``):

- ``"scaled_mm"``: ``torch.nn.functional.scaled_mm`` with ``ScalingType.BlockWise1x128`` x ``BlockWise128x128``
  (cuBLAS, sm90 only, CUDA >= 12.9; weight scales padded to a multiple of 4 along K and read K-major, as torch's
  ``_scaled_mm_v2`` checks them). Needs ``N`` and ``K`` multiples of 128. Checked once per device against the
  ``"torch"`` kernel on a small product before it is chosen (:func:`block_kernel`).
- ``"triton"``: :func:`triton_block_gemm`, a Triton kernel of piecegraph's own (any sm89+ GPU, any shape,
  power-of-two blocks): per K block, an FP8 ``tl.dot`` into float32 times the row's and the weight block's scales.
- ``"torch"``: the same e4m3 values multiplied in float32 (CPU, and the reference the GPU tests compare against).

Error bound, as :mod:`piecegraph.models.fp8` states for its per-tensor form: each output is within
``(2^-3 + 2^-8) * (|x| @ |w|^T)`` of the product of the unquantized activations and the checkpoint's dequantized
weights (the activation's own e4m3 rounding, ``2^-4`` relative, is the only new error: the weights are exact).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from piecegraph.models.fp8 import E4M3_MAX, FP8, quantize_rows
from piecegraph.ops.opaque import opaque

BLOCK_KERNELS = ("scaled_mm", "triton", "torch")


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``x [M, K]`` in e4m3, each row's groups of ``group`` columns scaled so their largest
    magnitude is 448 (a last partial group too), and the float32 ``[M, ceil(K/group)]`` scales that undo it."""
    m, k = x.shape
    pad = -k % group
    xp = nn.functional.pad(x.float(), (0, pad)).view(m, -1, group)
    scale = xp.abs().amax(-1).clamp(min=1e-12) / E4M3_MAX
    q = (xp / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8).view(m, -1)[:, :k]
    return q, scale


def quantize_weight_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale_inv)``: ``w [N, K]`` in e4m3 with one float32 scale per ``block`` (edge blocks partial), the
    layout of DeepSeek's ``weight_scale_inv`` (``w ~ q * scale_inv[i // bn, j // bk]``)."""
    (n, k), (bn, bk) = w.shape, block
    wp = nn.functional.pad(w.float(), (0, -k % bk, 0, -n % bn))
    tiles = wp.view(wp.shape[0] // bn, bn, wp.shape[1] // bk, bk)
    scale = tiles.abs().amax((1, 3)).clamp(min=1e-12) / E4M3_MAX
    q = (tiles / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8).view_as(wp)[:n, :k]
    return q.contiguous(), scale


def expand_blocks(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """``scale [ceil(rows/bn), ceil(cols/bk)]`` repeated over its blocks, cut to ``[rows, cols]``."""
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def torch_block_gemm(q: torch.Tensor, q_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """The reference: ``(q * q_scale) @ (w * w_scale)^T`` in float32, cast to ``out_dtype``."""
    a = q.float() * q_scale.repeat_interleave(block[1], 1)[:, : q.shape[1]]
    b = w.float() * expand_blocks(w_scale, *w.shape, block)
    return (a @ b.t()).to(out_dtype)


def _scaled_mm_fake(q: torch.Tensor, q_scale: torch.Tensor, w: torch.Tensor, w_scale_kmajor: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    return q.new_empty(q.shape[0], w.shape[0], dtype=out_dtype)


@opaque(fake=_scaled_mm_fake, name="fp8_block_gemm_cublas")
def scaled_mm_block_gemm(q: torch.Tensor, q_scale: torch.Tensor, w: torch.Tensor, w_scale_kmajor: torch.Tensor,
                         out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS's blockwise FP8 GEMM: ``q [M, K]`` e4m3 with ``q_scale [M, K/128]``, ``w [N, K]`` e4m3 with
    ``w_scale_kmajor`` the ``[N/128, round_up(K/128, 4)]`` padded weight scales (:func:`pad_weight_scale`).
    Returns a new ``[M, N]`` tensor. One opaque op: Dynamo cannot trace ``_scaled_mm_v2``, and the layouts cuBLAS
    checks (M-major activation scales) are built here, where no compiler reorders them."""
    f = nn.functional
    m, kb = q_scale.shape
    # cuBLAS reads the activation scales M-major with an aligned leading dimension: rows are padded to a multiple
    # of 16 (pad rows: zero values, unit scales; their outputs are dropped)
    rows = m + (-m % 16)
    a_scale = torch.empty_strided((rows, kb), (1, rows), dtype=torch.float32, device=q.device)
    a_scale[:m].copy_(q_scale)
    a_scale[m:].fill_(1.0)
    if rows != m:
        q = torch.cat([q, q.new_zeros(rows - m, q.shape[1])])
    out = f.scaled_mm(q, w.t(), a_scale, f.ScalingType.BlockWise1x128, w_scale_kmajor.t(),
                      f.ScalingType.BlockWise128x128, output_dtype=out_dtype)
    return out[:m] if rows != m else out


def pad_weight_scale(scale: torch.Tensor) -> torch.Tensor:
    """``scale [N/128, K/128]`` padded with ones to ``[N/128, round_up(K/128, 4)]``, contiguous: its ``.t()`` is
    the ``[L4, N/128]`` stride ``(1, L4)`` layout ``scaled_mm``'s 128x128 recipe checks."""
    return nn.functional.pad(scale.float(), (0, -scale.shape[1] % 4), value=1.0).contiguous()


@functools.cache
def _triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_block_gemm(a, b, c, a_s, b_s, M, N, K, K_BLOCKS, stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        a_ptr = a + rm[:, None] * stride_am + rk[None, :]
        b_ptr = b + rn[None, :] * stride_bn + rk[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, K_BLOCKS):
            left = K - kb * BLOCK_K
            x = tl.load(a_ptr, mask=(rm[:, None] < M) & (rk[None, :] < left), other=0.0)
            y = tl.load(b_ptr, mask=(rn[None, :] < N) & (rk[:, None] < left), other=0.0)
            sa = tl.load(a_s + rm * stride_asm + kb, mask=rm < M, other=0.0)
            sb = tl.load(b_s + (rn // GROUP_N) * stride_bsn + kb, mask=rn < N, other=0.0)
            acc += tl.dot(x, y) * sa[:, None] * sb[None, :]
            a_ptr += BLOCK_K
            b_ptr += BLOCK_K
        tl.store(c + rm[:, None] * stride_cm + rn[None, :], acc.to(c.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    return fp8_block_gemm


def _block_gemm_fake(q: torch.Tensor, q_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    return q.new_empty(q.shape[0], w.shape[0], dtype=out_dtype)


@opaque(fake=_block_gemm_fake, name="fp8_block_gemm_triton")
def triton_block_gemm(q: torch.Tensor, q_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                      block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """piecegraph's Triton blockwise FP8 GEMM, the same product as :func:`torch_block_gemm`. ``q [M, K]`` and
    ``w [N, K]`` row-major e4m3; ``q_scale [M, ceil(K/bk)]``, ``w_scale [ceil(N/bn), ceil(K/bk)]`` float32,
    contiguous. Tile sizes by ``M`` (fixed per call shape: nothing is tuned at run time, so graphs capture it).
    One opaque op (:func:`piecegraph.opaque`): Dynamo records a node and never traces the launch."""
    m, k = q.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=q.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 64 else 128
    grid = (-(-m // block_m), -(-n // block_n))
    _triton_kernel()[grid](q, w, out, q_scale, w_scale, m, n, k, q_scale.shape[1], q.stride(0), w.stride(0),
                           out.stride(0), q_scale.stride(0), w_scale.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
                           BLOCK_K=block[1], GROUP_N=block[0], num_warps=4, num_stages=3)
    return out


def _triton_runs(device: torch.device) -> bool:
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _scaled_mm_runs(device: torch.device) -> bool:
    """Whether cuBLAS's 1x128 x 128x128 FP8 GEMM runs on ``device`` and equals the ``"torch"`` kernel on
    1, 10 and 256 rows times a 256 x 384 weight (a torch or CUDA build without it raises, or would be wrong: then
    it is not chosen)."""
    f = nn.functional
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9 or not hasattr(f, "ScalingType"):
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(256, 384, device=device, generator=gen)
    wq, ws = quantize_weight_blocks(w)
    for rows in (1, 10, 256):  # a decode row, a ragged count, a full tile
        q, qs = quantize_groups(torch.randn(rows, 384, device=device, generator=gen), 128)
        try:
            got = scaled_mm_block_gemm(q, qs, wq, pad_weight_scale(ws), torch.bfloat16).float()
        except (RuntimeError, NotImplementedError, ValueError, TypeError):
            return False
        want = torch_block_gemm(q, qs, wq, ws, (128, 128), torch.float32)
        if not ((got - want).norm() / want.norm()) < 1e-2:
            return False
    return True


def block_kernel(device: torch.device | str, n: int, k: int, block: tuple[int, int]) -> str:
    """The blockwise kernel for an ``[n, k]`` weight in ``block`` blocks on ``device``: ``"scaled_mm"`` where cuBLAS
    has it and it checked out (sm90, 128x128, ``n`` and ``k`` multiples of 128), else ``"triton"`` on an sm89+
    GPU with Triton, else ``"torch"``."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if tuple(block) == (128, 128) and n % 128 == 0 and k % 128 == 0 and _scaled_mm_runs(device):
        return "scaled_mm"
    return "triton" if _triton_runs(device) else "torch"


class FP8BlockLinear(nn.Module):
    """``y = x @ dequant(weight)^T + bias`` for a block-scaled checkpoint weight: ``weight [N, K]`` e4m3 and
    ``weight_scale_inv [ceil(N/bn), ceil(K/bk)]`` float32 are buffers (the checkpoint's own tensors, unchanged);
    ``x [..., K]`` any leading shape, quantized per token in 1 x ``bk`` groups; output in ``out_dtype``.
    ``kernel``: one of :data:`BLOCK_KERNELS`, default :func:`block_kernel`'s choice where the weight is."""

    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block: tuple[int, int],
                 bias: torch.Tensor | None, out_dtype: torch.dtype, kernel: str | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.block, self.out_dtype = tuple(block), out_dtype
        kernel = kernel or block_kernel(weight.device, *weight.shape, self.block)
        if kernel not in BLOCK_KERNELS:
            raise ValueError(f"kernel must be one of {BLOCK_KERNELS}, got {kernel!r}")
        self.kernel = kernel
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale_inv", weight_scale_inv.float().contiguous())
        # scaled_mm reads the scales padded and K-major: kept beside the checkpoint's, 1/16384 of the weight bytes
        padded = pad_weight_scale(self.weight_scale_inv) if kernel == "scaled_mm" else None
        self.register_buffer("scale_kmajor", padded, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        # looked up once: the forward calls the kernel through this attribute (automatic opaque can route it)
        self.gemm = {"triton": triton_block_gemm, "torch": torch_block_gemm}.get(kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        q, scale = quantize_groups(x.reshape(-1, self.in_features), self.block[1])
        if self.kernel == "scaled_mm":
            y = scaled_mm_block_gemm(q, scale, self.weight, self.scale_kmajor, self.out_dtype)
        else:
            y = self.gemm(q, scale, self.weight, self.weight_scale_inv, self.block, self.out_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, kernel={self.kernel}, e4m3 weight in "
                f"{self.block[0]}x{self.block[1]} blocks")


class FP8ChannelLinear(nn.Module):
    """``y = x @ dequant(weight)^T + bias`` for a per-channel (or per-tensor, broadcast) FP8 weight:
    ``weight [N, K]`` e4m3 and ``weight_scale [N]`` float32 buffers; ``x`` quantized per token.
    ``torch._scaled_mm`` with row-wise scales on sm89+ CUDA (``N`` and ``K`` multiples of 16), float32 products
    of the same e4m3 values elsewhere."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.out_dtype = out_dtype
        cuda = weight.device.type == "cuda" and torch.cuda.get_device_capability(weight.device) >= (8, 9)
        self.kernel = "scaled_mm" if cuda and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0 else "torch"
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale.float().reshape(-1).expand(weight.shape[0]).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        q, scale = quantize_rows(x.reshape(-1, self.in_features))
        if self.kernel == "scaled_mm":
            y = torch._scaled_mm(q, self.weight.t(), scale_a=scale.unsqueeze(-1),
                                 scale_b=self.weight_scale.unsqueeze(0), out_dtype=torch.bfloat16).float()
        else:
            y = (q.float() @ self.weight.float().t()) * (scale.unsqueeze(-1) * self.weight_scale)
        y = y.to(self.out_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kernel={self.kernel}, e4m3 per-channel weight"


def swap_fp8_linears(model: nn.Module, out_dtype: torch.dtype) -> int:
    """Replace, in place, every linear of ``model`` that holds an e4m3 ``weight`` beside a ``weight_scale_inv``
    and a ``block_size`` (transformers' ``FP8Linear``, whose forward needs a kernel fetched from the hub) by
    :class:`FP8BlockLinear` (``block_size`` set) or :class:`FP8ChannelLinear` (per-tensor) on the same tensors,
    outputs in ``out_dtype``. Static activation scales are not used: activations are quantized per token.
    Returns how many were replaced."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            weight, scale = getattr(child, "weight", None), getattr(child, "weight_scale_inv", None)
            if not (isinstance(weight, torch.Tensor) and weight.dtype == FP8 and isinstance(scale, torch.Tensor)
                    and hasattr(child, "block_size")):
                continue
            bias = child.bias.detach().to(out_dtype) if getattr(child, "bias", None) is not None else None
            if child.block_size is None:
                new = FP8ChannelLinear(weight.detach(), scale.detach(), bias, out_dtype)
            else:
                new = FP8BlockLinear(weight.detach(), scale.detach(), tuple(child.block_size), bias, out_dtype)
            setattr(parent, name, new)
            swapped += 1
    return swapped
