"""The Triton grouped FP8 GEMM (piecegraph.models.fp8_grouped_triton) against a float64 product of the same e4m3
values, on random ragged groups (empty ones, one row, more rows than a tile), under Triton's interpreter or on CUDA."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from piecegraph.models.fp8 import quantize_rows
from piecegraph.models.fp8_grouped import quantize_channels
from piecegraph.models.fp8_grouped_triton import grouped_fp8_gemm, tile_config
from tests.cpu.triton_device import kernel_device


def _reference(q, scale, w, w_scale, counts):
    expert = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    q, scale, w, w_scale = (t.cpu().double() for t in (q, scale, w, w_scale))
    return torch.einsum("mk,mnk->mn", q, w[expert]) * scale[:, None] * w_scale[expert]


@settings(max_examples=12, deadline=None)
@given(counts=st.lists(st.integers(0, 40), min_size=1, max_size=6), n=st.integers(1, 70), k=st.integers(1, 50),
       bm=st.sampled_from([16, 32]), seed=st.integers(0, 2**16))
def test_grouped_fp8_gemm_equals_the_float64_product(counts, n, k, bm, seed):
    device = kernel_device()
    gen = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    q, scale = quantize_rows(torch.randn(rows, k, generator=gen))
    w, w_scale = quantize_channels(torch.randn(len(counts), n, k, generator=gen))
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    config = {"BM": bm, "BN": 32, "BK": 16, "num_warps": 4, "num_stages": 1}  # small tiles: many K steps, edges
    got = grouped_fp8_gemm(*(t.to(device) for t in (q, scale, w, w_scale, ends)), out_dtype=torch.float32,
                           config=config)
    want = _reference(q, scale, w, w_scale, counts)
    assert got.shape == (rows, n)
    # float32 accumulation of exact e4m3 products: a few ulps of the sum of magnitudes
    bound = 1e-5 * _reference(q.abs(), scale, w.abs(), w_scale, counts) + 1e-30
    assert ((got.cpu().double() - want).abs() <= bound).all()


def test_tile_height_follows_the_rows_per_expert():
    heights = [tile_config(rows, 60)["BM"] for rows in (4, 960, 2880, 8192, 60 * 400)]
    assert heights == [16, 16, 32, 64, 128]


def test_the_run_time_checks_say_why_a_kernel_is_not_used():
    """A path whose check fails is not measured, and the reason names the error or the distance and its limit."""
    from piecegraph.models import fp8_grouped

    assert fp8_grouped.triton_gemm_failure("cpu") == "needs Triton on a CUDA device"
    assert fp8_grouped.native_failure("cpu").startswith("NotImplementedError")  # no CPU _scaled_grouped_mm
    ones = torch.ones(4)
    assert fp8_grouped._mismatch(lambda: ones, lambda: ones, -7) is None
    assert fp8_grouped._mismatch(lambda: ones * 1.01, lambda: ones, -7) == (
        "relative error 0.01 against the float32 product (limit 2^-7)")
    assert fp8_grouped._mismatch(lambda: ones[:9] @ ones[:3], lambda: ones, -7).startswith("RuntimeError")


def test_mismatched_operands_are_refused_by_name():
    """A K that differs, or a weight whose K is not contiguous, is refused before any kernel runs."""
    import pytest

    q, scale = quantize_rows(torch.randn(4, 16))
    w, w_scale = quantize_channels(torch.randn(2, 8, 12))
    ends = torch.tensor([2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="must share K with K contiguous"):
        grouped_fp8_gemm(q, scale, w, w_scale, ends)
    w, w_scale = quantize_channels(torch.randn(2, 8, 16))
    with pytest.raises(ValueError, match="must share K with K contiguous"):
        grouped_fp8_gemm(q, scale, w.transpose(1, 2).contiguous().transpose(1, 2), w_scale, ends)
