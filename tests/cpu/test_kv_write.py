"""``write_kv``: one kernel writes a step's keys and values at their slots, exactly as two ``index_copy_`` calls
(the reference) do, for strided rows (a fused QKV output's slices), casts and pad rows that share a slot. The
kernel runs where Triton does (CUDA, or ``TRITON_INTERPRET=1`` on CPU); the fallback runs everywhere."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_device import kernel_device

from piecegraph.attention.backends import kv_write


def _case(rows, kv_heads, dim, v_dim, dtype, device, seed, slots_total=64):
    gen = torch.Generator().manual_seed(seed)
    width = kv_heads * (dim + v_dim) + 3  # a fused projection's output: k and v slices with a row stride
    qkv = torch.randn(rows, width, generator=gen).to(dtype).to(device)
    k = qkv[:, : kv_heads * dim].view(rows, kv_heads, dim)
    v = qkv[:, kv_heads * dim: kv_heads * (dim + v_dim)].view(rows, kv_heads, v_dim)
    caches = [torch.randn(slots_total, kv_heads, d, generator=gen).to(device) for d in (dim, v_dim)]
    slots = torch.randperm(slots_total, generator=gen)[:rows].to(device)
    return k, v, caches, slots


def _reference(k, v, caches, slots):
    kc, vc = (c.clone() for c in caches)
    kc.index_copy_(0, slots, k.to(kc.dtype))
    vc.index_copy_(0, slots, v.to(vc.dtype))
    return kc, vc


# (rows' dtype, cache dtype): as served, and a widening cast (exact, so equal bits on either rounding; Triton's
# interpreter truncates a narrowing cast where CUDA rounds)
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
@pytest.mark.parametrize("rows, kv_heads, dim, v_dim", [(1, 8, 64, 64), (5, 2, 8, 16), (16, 3, 24, 8)])
def test_the_kernel_writes_what_index_copy_writes(rows, kv_heads, dim, v_dim, dtype, cache_dtype):
    device = kernel_device()
    k, v, caches, slots = _case(rows, kv_heads, dim, v_dim, dtype, device, seed=rows)
    caches = [c.to(cache_dtype) for c in caches]
    assert kv_write.fused_write_runs(k, v, *caches)
    want = _reference(k, v, caches, slots)
    kv_write.write_kv(k, v, *caches, slots)
    for got, expected in zip(caches, want):
        assert torch.equal(got, expected)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 12), kv_heads=st.integers(1, 4), dim=st.sampled_from([4, 8, 12]),
       v_dim=st.sampled_from([4, 8]), seed=st.integers(0, 999), contiguous=st.booleans(), pads=st.integers(0, 3))
def test_either_path_equals_index_copy(rows, kv_heads, dim, v_dim, seed, contiguous, pads):
    """Whichever path runs (the kernel where Triton does, else the fallback), the caches equal the reference;
    pad rows aimed at one scratch slot write nothing else."""
    k, v, caches, slots = _case(rows, kv_heads, dim, v_dim, torch.float32, "cpu", seed)
    if contiguous:
        k, v = k.contiguous(), v.contiguous()
    scratch = int(slots[0])
    slots = torch.cat([slots, torch.full((pads,), scratch)])
    k = torch.cat([k, torch.zeros(pads, kv_heads, dim)]) if pads else k
    v = torch.cat([v, torch.zeros(pads, kv_heads, v_dim)]) if pads else v
    keep = [c.clone() for c in caches]
    kv_write.write_kv(k, v, *caches, slots)
    rest = torch.ones(caches[0].shape[0], dtype=torch.bool)
    rest[slots] = False
    for got, before, new in zip(caches, keep, (k, v)):
        assert torch.equal(got[rest], before[rest])  # no other slot touched
        for row in range(rows):
            if pads and int(slots[row]) == scratch:
                continue  # shared with the pad rows: any one of them may land
            assert torch.equal(got[slots[row]], new[row])


def test_rows_the_kernel_cannot_read_take_the_fallback():
    k = torch.randn(4, 2, 8).transpose(1, 2).contiguous().transpose(1, 2)  # heads not contiguous within a row
    v = torch.randn(4, 2, 8)
    caches = [torch.zeros(16, 2, 8), torch.zeros(16, 2, 8)]
    assert not kv_write.fused_write_runs(k, v, *caches)
    slots = torch.tensor([3, 0, 9, 15])
    want = _reference(k, v, caches, slots)
    kv_write.write_kv(k, v, *caches, slots)
    assert all(torch.equal(a, b) for a, b in zip(caches, want))


def test_a_capture_never_compiles_the_kernel(monkeypatch):
    """Under a capture, a signature not run eagerly before takes index_copy_; once run eagerly, the kernel."""
    calls = []
    real = kv_write.write_kv
    monkeypatch.setattr(kv_write, "write_kv", lambda *a, fused=True: calls.append(fused) or real(*a, fused=fused))
    capturing = [True]
    monkeypatch.setattr(kv_write, "_capturing", lambda t: capturing[0])
    writer = kv_write.KVWriter()
    k, v, caches, slots = _case(3, 2, 8, 8, torch.float32, "cpu", seed=1)
    want = _reference(k, v, caches, slots)
    writer(k, v, *caches, slots)  # captured, never seen: the fallback
    capturing[0] = False
    writer(k, v, *caches, slots)  # eager: the kernel where it runs (its signature now seen)
    capturing[0] = True
    writer(k, v, *caches, slots)  # captured, seen: the kernel
    writer(k.to(torch.float64), v.to(torch.float64), *caches, slots)  # another dtype, unseen: the fallback
    assert calls == [False, True, True, False]
    assert all(torch.equal(a, b) for a, b in zip(caches, want))


def test_a_kernel_that_does_not_build_falls_back_to_index_copy_with_a_warning(monkeypatch):
    def broken():
        raise RuntimeError("no compiler")

    monkeypatch.setattr(kv_write, "fused_write_runs", lambda *a: True)
    monkeypatch.setattr(kv_write, "_kernel", broken)
    writer = kv_write.KVWriter()
    k, v, caches, slots = _case(3, 2, 8, 8, torch.float32, "cpu", seed=2)
    want = _reference(k, v, caches, slots)
    with pytest.warns(UserWarning, match="did not build.*no compiler.*index_copy_"):
        writer(k, v, *caches, slots)
    writer(k, v, *caches, slots)  # remembered: no second attempt, no second warning
    assert all(torch.equal(a, b) for a, b in zip(caches, want)) and len(writer.failed) == 1


def test_keys_of_another_width_than_the_cache_are_an_error_not_a_write():
    k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    caches = [torch.zeros(16, 2, 4), torch.zeros(16, 2, 8)]  # the key cache is 4 wide, the keys 8
    assert not kv_write.fused_write_runs(k, v, *caches)
    with pytest.raises(RuntimeError):
        kv_write.write_kv(k, v, *caches, torch.tensor([1, 2]))
    assert not caches[0].any() and not caches[1].any()  # nothing written
