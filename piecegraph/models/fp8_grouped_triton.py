"""A grouped FP8 GEMM in Triton: the second FP8 kernel :mod:`piecegraph.models.fp8_grouped` measures per token
count, beside ``torch._scaled_grouped_mm``.

Rows arrive sorted by expert (``ends``: each expert's group end, int32). The grid is static for a row count ``M``:
``cdiv(M, BM) + E`` row tiles (each expert's last tile may be partial, so at most ``E`` more than a dense tiling)
times ``cdiv(N, BN)`` column tiles. Each program finds its expert on the device from ``ends`` (the tiles per expert,
their prefix sum, and the count of tile ends at or below its own tile index), so nothing is read on the host and a
CUDA graph of one ``M`` replays any routing. Spare tiles exit at once. The product of e4m3 tiles accumulates in
float32 (``tl.dot``), then takes each row's activation scale and each output channel's weight scale, as
``torch._scaled_grouped_mm`` with row-wise scales does.

Why a second kernel: on an H100 ``torch._scaled_grouped_mm`` lost to the bf16 grouped GEMM at 2,048 tokens of a
Qwen1.5-MoE layer (844 against 810 us) although it won at 1,024 (412 against 591 us); the tile height here follows
the rows per expert, which is what changes between those counts, and this kernel took 647 us there (whole layer,
CUDA graph replays, ``tests/gpu/test_fp8_grouped_gpu.py``'s recorded table). The caller makes every row belong to
a group (``ends[-1] == M``, as :class:`~piecegraph.models.fp8_moe.FP8Experts` does): rows past it are not written.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from piecegraph.ops.triton_support import next_power_of_two


def tile_config(rows: int, num_experts: int) -> dict[str, int]:
    """The tile sizes for ``rows`` sorted rows over ``num_experts`` experts: the tile height follows the mean rows
    per expert (a taller tile wastes the part of each expert's last tile it leaves empty), the rest is fixed."""
    per_expert = rows / max(num_experts, 1)
    bm = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64 if per_expert <= 160 else 128
    return {"BM": bm, "BN": 128, "BK": 128, "num_warps": 4 if bm <= 64 else 8, "num_stages": 3}


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_fp8_kernel(q, q_scale, w, w_scale, ends, out, M, N, K, E,
                           stride_q, stride_we, stride_wn, stride_se, stride_out,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr):
        tile = tl.program_id(0)
        experts = tl.arange(0, BE)
        group_end = tl.load(ends + experts, mask=experts < E, other=0)
        group_start = tl.load(ends + experts - 1, mask=(experts > 0) & (experts < E), other=0)
        tiles = tl.where(experts < E, (group_end - group_start + BM - 1) // BM, 0)
        tile_end = tl.cumsum(tiles, 0)
        if tile >= tl.sum(tiles, 0):
            return
        expert = tl.sum((tile_end <= tile).to(tl.int32), 0)  # the first expert whose tiles reach past ours
        mine = experts == expert
        first_tile = tl.sum(tl.where(mine, tile_end - tiles, 0), 0)
        row_end = tl.sum(tl.where(mine, group_end, 0), 0)
        rows = tl.sum(tl.where(mine, group_start, 0), 0) + (tile - first_tile) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        row_ok, col_ok = rows < row_end, cols < N
        ks = tl.arange(0, BK)
        a_ptr = q + rows.to(tl.int64)[:, None] * stride_q + ks[None, :]
        b_ptr = w + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k_ok = ks + k0 < K
            a = tl.load(a_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptr, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptr += BK
            b_ptr += BK
        acc *= tl.load(q_scale + rows, mask=row_ok, other=0.0)[:, None]
        acc *= tl.load(w_scale + expert * stride_se + cols, mask=col_ok, other=0.0)[None, :]
        dst = out + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
        tl.store(dst, acc.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    return grouped_fp8_kernel


def grouped_fp8_gemm(q: torch.Tensor, scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     ends: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                     config: dict[str, int] | None = None) -> torch.Tensor:
    """``out[i] = (q[i] @ w[e_i].T) * scale[i] * w_scale[e_i]`` for rows ``q [M, K]`` (e4m3, row-major) sorted by
    expert, ``e_i`` the expert whose group (``ends`` int32 ``[E]``, group ends, non-decreasing, ``ends[-1] <= M``)
    holds row ``i``; ``w [E, N, K]`` e4m3 with ``K`` contiguous, ``scale [M]`` and ``w_scale [E, N]`` float32.
    Rows past ``ends[-1]`` are left unwritten. Returns a new ``[M, N]`` tensor of ``out_dtype``. ``config``: tile
    sizes (default :func:`tile_config`). Needs Triton: CUDA, or CPU tensors under ``TRITON_INTERPRET=1``."""
    rows, k = q.shape
    e, n, k_w = w.shape
    if k_w != k or q.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"grouped_fp8_gemm: q [M, K] and w [E, N, K] must share K with K contiguous; got q "
                         f"{tuple(q.shape)} stride {q.stride()}, w {tuple(w.shape)} stride {w.stride()}")
    out = torch.empty(rows, n, dtype=out_dtype, device=q.device)
    if rows == 0:
        return out
    cfg = config or tile_config(rows, e)
    bm, bn = cfg["BM"], cfg["BN"]
    grid = (-(-rows // bm) + e, -(-n // bn))
    _kernel()[grid](q, scale, w, w_scale, ends, out, rows, n, k, e, q.stride(0), w.stride(0), w.stride(1),
                    w_scale.stride(0), out.stride(0), BM=bm, BN=bn, BK=cfg["BK"], BE=next_power_of_two(e),
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
