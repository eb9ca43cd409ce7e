"""The paged KV cache, per-step metadata and the torch attention backend, against an independent float64 model.

The reference keeps every sequence's keys and values densely, in float64, and attends token by token with an
explicit softmax: it knows nothing of pages, groups, folding or masks.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import piecegraph
from piecegraph.attention import AttentionMetadata, KVCache, OutOfPagesError
from piecegraph.context import forward_context
from piecegraph.models import TINY

CFG = TINY.replace(num_heads=6, num_kv_heads=2, head_dim=8, attention_backend="torch")
H, HKV, D = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim


def _shuffled_cache(num_pages: int, page_size: int, seed: int, max_seq_len: int = 64) -> KVCache:
    """A cache whose pages are handed out in random order, so page tables are not contiguous."""
    cache = KVCache(CFG, num_pages, page_size, max_seq_len=max_seq_len)
    random.Random(seed).shuffle(cache._free)
    for k, v in zip(cache.k, cache.v):  # garbage everywhere: unwritten slots must never be read
        k.normal_()
        v.normal_()
    return cache


class Reference:
    """Dense float64 k/v per sequence and per-token attention (GQA by repeat: q head h uses kv head h // G)."""

    def __init__(self) -> None:
        self.k: dict = {}
        self.v: dict = {}

    def step(self, seqs, q, k, v) -> torch.Tensor:
        out, row = [], 0
        for seq, cached, new in seqs:
            self.k[seq] = torch.cat([self.k.get(seq, torch.zeros(0, HKV, D, dtype=torch.float64)), k[row:row + new]])
            self.v[seq] = torch.cat([self.v.get(seq, torch.zeros(0, HKV, D, dtype=torch.float64)), v[row:row + new]])
            assert self.k[seq].shape[0] == cached + new
            for i in range(new):
                visible = cached + i + 1  # causal: the token sees itself and everything before it
                for h in range(H):
                    keys, values = self.k[seq][:visible, h // (H // HKV)], self.v[seq][:visible, h // (H // HKV)]
                    weights = torch.softmax(keys @ q[row + i, h] / D ** 0.5, dim=0)
                    out.append(weights @ values)
            row += new
        return torch.stack(out).view(-1, H, D)


def _run_op(cache: KVCache, seqs, q, k, v, layer: int = 0, pad: int = 0) -> torch.Tensor:
    meta = AttentionMetadata.for_batch(cache, seqs)
    rows = meta.num_tokens + pad
    out = torch.full((rows, H * D), float("nan"))
    with forward_context(meta):
        torch.ops.piecegraph_models.attention(_padded(q, pad), _padded(k, pad), _padded(v, pad), out, layer)
    assert (out[meta.num_tokens:] == 0).all()  # pad rows come out zero
    return out[: meta.num_tokens].view(-1, H, D)


def _padded(x: torch.Tensor, pad: int) -> torch.Tensor:
    flat = x.reshape(x.shape[0], -1).float()
    return torch.cat([flat, torch.randn(pad, flat.shape[1])])  # pad rows hold garbage, like a real bucket


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


# A step: for each live sequence, continue it (1 token = decode, more = chunked prefill) or leave it; new prompts.
step_strategy = st.lists(st.tuples(st.integers(0, 5), st.integers(1, 9)), min_size=1, max_size=6)


@settings(max_examples=25, deadline=None)
@given(steps=st.lists(step_strategy, min_size=1, max_size=4), page_size=st.sampled_from([1, 4, 16]),
       seed=st.integers(0, 2**16), pad=st.integers(0, 3))
def test_torch_backend_matches_float64_reference_over_mixed_steps(steps, page_size, seed, pad):
    cache, ref = _shuffled_cache(num_pages=200, page_size=page_size, seed=seed), Reference()
    gen, lengths = torch.Generator().manual_seed(seed), {}
    for step in steps:
        seqs, seen = [], set()
        for seq, new in step:
            if seq in seen or lengths.get(seq, 0) + new > cache.max_seq_len:
                continue
            seen.add(seq)
            seqs.append((seq, lengths.get(seq, 0), new))
        if not seqs:
            continue
        n = sum(new for _, _, new in seqs)
        q = torch.randn(n, H, D, generator=gen, dtype=torch.float64)
        k, v = (torch.randn(n, HKV, D, generator=gen, dtype=torch.float64) for _ in range(2))
        got = _run_op(cache, seqs, q, k, v, pad=pad)
        assert _rel(got, ref.step(seqs, q, k, v)) < 1e-5
        for seq, cached, new in seqs:
            lengths[seq] = cached + new


def test_decode_step_matches_reference_and_pages_are_not_contiguous():
    cache, ref = _shuffled_cache(num_pages=40, page_size=4, seed=7), Reference()
    gen = torch.Generator().manual_seed(1)
    prompts = [("a", 0, 9), ("b", 0, 3), ("c", 0, 14)]
    for seqs in (prompts, [(s, c + n, 1) for s, c, n in prompts]):
        n = sum(new for _, _, new in seqs)
        q, k, v = (torch.randn(n, h, D, generator=gen, dtype=torch.float64) for h in (H, HKV, HKV))
        got = _run_op(cache, seqs, q, k, v)
        assert _rel(got, ref.step(seqs, q, k, v)) < 1e-5
    tables = [cache.page_table(s) for s in "abc"]
    assert any(b - a != 1 for t in tables for a, b in zip(t, t[1:]))  # the test would be weak otherwise


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _ops_per_call(seqs) -> list[str]:
    cache = _shuffled_cache(num_pages=1000, page_size=4, seed=0)
    cache.reserve((s, c) for s, c, _ in seqs if c)
    n = sum(new for _, _, new in seqs)
    meta = AttentionMetadata.for_batch(cache, seqs)
    q, k, v, out = torch.randn(n, H * D), torch.randn(n, HKV * D), torch.randn(n, HKV * D), torch.empty(n, H * D)
    with forward_context(meta), _OpCounter() as counter:
        torch.ops.piecegraph_models.attention(q, k, v, out, 0)
    return counter.ops


def test_op_count_does_not_grow_with_the_number_of_sequences():
    def mixed(num):  # num decode rows, num prefills, num chunked continuations
        return ([(f"d{i}", 5 + i, 1) for i in range(num)] + [(f"p{i}", 0, 3 + i) for i in range(num)]
                + [(f"c{i}", 4, 2 + i) for i in range(num)])

    assert _ops_per_call(mixed(1)) == _ops_per_call(mixed(12))
    decode = [_ops_per_call([(i, 7 + i % 40, 1) for i in range(b)]) for b in (1, 64)]
    assert decode[0] == decode[1]
    assert len(decode[0]) <= 12  # writes, page gathers, one SDPA, the copy out


def test_running_out_of_pages_is_clear_and_frees_nothing():
    cache = _shuffled_cache(num_pages=9, page_size=4, seed=3)  # 8 usable pages
    AttentionMetadata.for_batch(cache, [("kept", 0, 10)])  # 3 pages
    table, free = cache.page_table("kept"), cache.num_free_pages
    with pytest.raises(OutOfPagesError, match=r"needs 6 more pages.*5 free of 8.*cache.free"):
        AttentionMetadata.for_batch(cache, [("kept", 10, 3), ("new", 0, 20)])
    assert cache.page_table("kept") == table and cache.num_free_pages == free
    assert cache.sequences() == ["kept"]
    assert cache.free("kept") == 3 and cache.num_free_pages == 8
    with pytest.raises(KeyError, match="'kept' has no pages"):
        cache.free("kept")
    AttentionMetadata.for_batch(cache, [("again", 0, 5)])  # 2 pages
    assert cache.discard("again") == 2 and cache.num_free_pages == 8  # what free does, for one with pages
    assert cache.discard("kept") == 0 and cache.num_free_pages == 8 and cache.sequences() == []  # no pages: none


def test_metadata_errors_name_the_problem():
    cache = _shuffled_cache(num_pages=20, page_size=4, seed=0, max_seq_len=16)
    with pytest.raises(ValueError, match="distinct"):
        AttentionMetadata.for_batch(cache, [(1, 0, 2), (1, 0, 3)])
    with pytest.raises(ValueError, match="claims 5 cached tokens but holds pages for only 0"):
        AttentionMetadata.for_batch(cache, [(1, 5, 1)])
    with pytest.raises(ValueError, match="beyond the KV cache's max_seq_len 16"):
        AttentionMetadata.for_batch(cache, [(1, 0, 17)])
    with pytest.raises(ValueError, match="num_new >= 1"):
        AttentionMetadata.for_batch(cache, [(1, 0, 0)])
    assert cache.sequences() == []  # nothing was reserved by the failed calls


def test_full_mode_refuses_a_prefill_step_with_a_clear_error():
    model = piecegraph.models.Decoder.random(CFG, seed=0)
    graphed = piecegraph.compile(model, mode="full", compiler="eager", capture_sizes=(4, 8), emulate_graphs=True)
    cache = _shuffled_cache(num_pages=40, page_size=4, seed=0)
    meta = AttentionMetadata.for_batch(cache, [(0, 0, 3), (1, 0, 2)])
    with forward_context(meta), pytest.raises(ValueError, match="pure decode steps only.*piecewise"):
        graphed(torch.arange(5), meta.positions)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40)), min_size=1, max_size=30),
       page_size=st.sampled_from([1, 4, 16]), seed=st.integers(0, 99))
def test_device_page_table_mirrors_the_host_tables_and_gathers_the_same_layouts(ops, page_size, seed):
    """Random grows and frees (length 0 = free): the device table, updated incrementally, equals the host page
    lists row by row (scratch elsewhere, row 0 all scratch); a decode step's gathered dense table and FlashInfer's
    gathered CSR ``kv_indices`` equal the ones built from the host lists."""
    from piecegraph.attention.backends.flashinfer_layout import page_layout

    cache = _shuffled_cache(num_pages=40, page_size=page_size, seed=seed)
    lengths: dict = {}
    for seq, length in ops:
        if length == 0 or length < lengths.get(seq, 0):
            if seq in lengths:
                cache.free(seq)
                del lengths[seq]
            continue
        try:
            cache.reserve([(seq, length)])
        except OutOfPagesError:
            continue
        lengths[seq] = length
    table = cache.device_table()
    assert (table[0] == 0).all()
    for seq in lengths:
        pages = cache.page_table(seq)
        row = table[cache.slot(seq)].tolist()
        assert row == pages + [0] * (cache.max_pages_per_seq - len(pages)), seq
    assert sorted(cache.slot(s) for s in lengths) == sorted({cache.slot(s) for s in lengths})  # distinct rows
    if not lengths:
        return
    meta = AttentionMetadata.for_decode(cache, [(seq, n - 1) for seq, n in lengths.items()])
    want = [cache.page_table(s) + [0] * (cache.max_pages_per_seq - len(cache.page_table(s))) for s in lengths]
    assert meta.page_table.tolist() == want and meta.page_table.dtype == torch.int64
    layout = meta.layout
    host_pages = layout.__class__(layout.seq_ids, layout.num_new, layout.kv_lens,
                                  tuple(cache.page_table(s) for s in layout.seq_ids), page_size)  # no slots
    gathered, _ = page_layout(layout, cache.device, table=cache.device_table())
    built, _ = page_layout(host_pages, cache.device)
    for name in ("kv_indices", "kv_indptr", "kv_last_page_len"):
        assert torch.equal(gathered[name], built[name]), name
