"""The vectorized step building equals the per-row algorithm it replaced, tensor for tensor.

Each reference below is the old per-row code, written plainly: per-token positions and cache slots walked from
the host page lists, FlashInfer's CSR page layout built row by row, the step's input ids token by token. Random
batches (sequence lengths, page sizes, new-token counts, decode-only and mixed, with and without the cache's
device page table, pages handed out in shuffled order) must give identical tensors (values, dtypes, shapes).
"""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from piecegraph.attention import AttentionMetadata
from piecegraph.attention.backends.flashinfer_layout import HostInts, page_layout
from piecegraph.attention.kv_cache import KVCache
from piecegraph.models import TINY
from piecegraph.serve.inputs import build_inputs
from piecegraph.serve.request import Request, SamplingParams, _token
from piecegraph.serve.scheduler import Row

MAX_LEN = 96


class _Stub:
    """A backend that plans nothing; ``reads_page_table`` picks the torch-like or the FlashInfer-like path."""

    name = "stub"

    def __init__(self, reads_page_table: bool) -> None:
        self.reads_page_table = reads_page_table

    def plan(self, meta: AttentionMetadata) -> None:
        pass


class _HostOnly:
    """A paged cache without a device page table (its page layouts are built from host lists)."""

    def __init__(self, cache: KVCache) -> None:
        self._cache = cache

    def __getattr__(self, name: str):
        if name in ("device_table", "pages_view", "slot"):
            raise AttributeError(name)
        return getattr(self._cache, name)


def _cache(page_size: int, seed: int) -> KVCache:
    cache = KVCache(TINY.replace(num_layers=1, max_seq_len=MAX_LEN), 80 * MAX_LEN + 1, page_size, backend="torch")
    random.Random(seed).shuffle(cache._free)  # pages out of order, as after many frees
    return cache


# -- the old per-row algorithms -------------------------------------------------------------------------
def _ref_tokens(cache, seqs):
    positions, slots = [], []
    for seq, cached, new in seqs:
        pages = cache.page_table(seq)
        for p in range(cached, cached + new):
            positions.append(p)
            slots.append(pages[p // cache.page_size] * cache.page_size + p % cache.page_size)
    return positions, slots


def _ref_page_layout(cache, seqs):
    ps = cache.page_size
    qo, kv_indptr, indices, last = [0], [0], [], []
    for seq, cached, new in seqs:
        kv = cached + new
        used = -(-kv // ps)
        indices += cache.page_table(seq)[:used]
        qo.append(qo[-1] + new)
        kv_indptr.append(kv_indptr[-1] + used)
        last.append(kv - (used - 1) * ps)
    return {"qo_indptr": qo, "kv_indptr": kv_indptr, "kv_last_page_len": last, "kv_indices": indices}


def _ref_inputs(rows, previous_index):
    flat, dst, src, ends, sampled, offset = [], [], [], [], [], 0
    for r in rows:
        tokens = [*r.request.prompt, *r.request.output]
        stop = r.cached + r.new
        if stop > len(tokens):
            flat += tokens[r.cached:] + [0]
            dst.append(offset + r.new - 1)
            src.append(previous_index[r.request])
        else:
            flat += tokens[r.cached:stop]
        offset += r.new
        if stop == r.request.num_tokens:
            ends.append(offset - 1)
            sampled.append(r.request)
    return flat, dst, src, (None if len(ends) == offset else ends), sampled


# -- random batches -------------------------------------------------------------------------------------
@st.composite
def _batches(draw):
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    decode = draw(st.booleans())
    # decode steps of up to 80 rows and mixed steps of up to 12: both sides of SMALL_STEP (64 tokens), where
    # the layouts switch from per-token Python to whole-tensor ops
    n = draw(st.integers(1, 80 if decode else 12))
    seqs = []
    for i in range(n):
        if decode:
            seqs.append((i, draw(st.integers(0, MAX_LEN - 1)), 1))
        else:
            cached = draw(st.integers(0, MAX_LEN - 1))
            seqs.append((i, cached, draw(st.integers(1, MAX_LEN - cached))))
    return page_size, seqs, draw(st.integers(0, 999))


def _step(page_size, seqs, seed, device_table, reads_page_table):
    cache = _cache(page_size, seed)
    for seq, cached, _ in seqs:  # earlier tokens went through the cache
        if cached:
            cache.reserve([(seq, cached)])
    cache.backend = _Stub(reads_page_table)
    view = cache if device_table else _HostOnly(cache)
    return cache, AttentionMetadata.for_batch(view, seqs)


@settings(max_examples=150, deadline=None)
@given(batch=_batches(), device_table=st.booleans(), reads_page_table=st.booleans())
def test_metadata_equals_the_per_row_algorithm(batch, device_table, reads_page_table):
    page_size, seqs, seed = batch
    cache, meta = _step(page_size, seqs, seed, device_table, reads_page_table)
    positions, slots = _ref_tokens(cache, seqs)
    assert meta.positions.dtype == meta.slot_mapping.dtype == torch.int64
    assert meta.positions.tolist() == positions
    assert meta.slot_mapping.tolist() == slots
    decode = all(new == 1 for _, _, new in seqs)
    if decode:
        assert meta.kv_lens.dtype == torch.int64 and meta.kv_lens.tolist() == [c + 1 for _, c, _ in seqs]
    else:
        assert meta.kv_lens is None
    if decode and reads_page_table:
        width = cache.max_pages_per_seq
        want = [cache.page_table(s) + [0] * (width - len(cache.page_table(s))) for s, _, _ in seqs]
        assert meta.page_table.dtype == torch.int64 and meta.page_table.tolist() == want
    else:
        assert meta.page_table is None


@settings(max_examples=150, deadline=None)
@given(batch=_batches(), device_table=st.booleans(), indices_only=st.booleans())
def test_flashinfer_page_layout_equals_the_per_row_algorithm(batch, device_table, indices_only):
    page_size, seqs, seed = batch
    cache, meta = _step(page_size, seqs, seed, device_table, False)
    table = cache.device_table() if device_table else None
    dev, cpu = page_layout(meta.layout, cache.device, indices_only=indices_only, table=table)
    want = _ref_page_layout(cache, seqs)
    for name in ("qo_indptr", "kv_indptr", "kv_last_page_len"):
        assert cpu[name].dtype == torch.int32 and cpu[name].tolist() == want[name], name
    kv_lens = [cached + new for _, cached, new in seqs]
    assert cpu["seq_lens"].dtype == torch.int32 and cpu["seq_lens"].tolist() == kv_lens
    # what FlashInfer 0.5.3's plan() computes from them, the way it does: Python's max() over the host tensors
    qo = cpu["qo_indptr"]
    assert isinstance(qo, HostInts) and isinstance(cpu["seq_lens"], HostInts)
    assert max(cpu["seq_lens"]).item() == max(kv_lens)
    assert max(qo[1:] - qo[:-1]).item() == max(new for _, _, new in seqs)
    names = ["kv_indices"]
    names += [] if indices_only else ["kv_indptr", "kv_last_page_len"]
    assert sorted(dev) == sorted(names)
    for name in names:
        assert dev[name].dtype == torch.int32 and dev[name].tolist() == want[name], name


@settings(max_examples=100, deadline=None)
@given(data=st.data(), n=st.integers(1, 10))
def test_build_inputs_equals_the_per_row_algorithm(data, n):
    rows, index = [], {}
    for i in range(n):
        prompt = data.draw(st.lists(st.integers(0, 99), min_size=1, max_size=20))
        request = Request.make(i, prompt, SamplingParams(max_new_tokens=50))
        request.output = data.draw(st.lists(st.integers(0, 99), max_size=6))
        known = len(prompt) + len(request.output)
        if data.draw(st.booleans()):  # its last token is in flight: the row ends at it
            request.inflight = 1
            index[request] = data.draw(st.integers(0, 7))
            cached = data.draw(st.integers(0, known))
            rows.append(Row(request, cached, known + 1 - cached))
        else:
            cached = data.draw(st.integers(0, known - 1))
            rows.append(Row(request, cached, data.draw(st.integers(1, known - cached))))
    previous = torch.arange(100, 108)
    got = build_inputs(rows, torch.device("cpu"), previous, index)
    flat, dst, src, ends, sampled = _ref_inputs(rows, index)
    ids = torch.tensor(flat, dtype=torch.int64)
    if dst:
        ids[dst] = previous[src]
    assert got.input_ids.dtype == torch.int64 and torch.equal(got.input_ids, ids)
    assert (got.last_rows is None) == (ends is None)
    if ends is not None:
        assert got.last_rows.tolist() == ends
    assert got.sampled == sampled


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.integers(-2**31, 2**31 - 1), min_size=1, max_size=300))
def test_host_ints_iterate_as_python_ints_and_compute_as_tensors(values):
    plain = torch.tensor(values, dtype=torch.int32)
    fast = plain.clone().as_subclass(HostInts)
    assert [x.item() for x in fast] == [x.item() for x in plain] == values
    assert max(fast).item() == max(values) and min(fast).item() == min(values)
    diff = fast[1:] - fast[:-1]  # torch ops keep the type (FlashInfer's max over qo_indptr differences)
    assert isinstance(diff, HostInts) and torch.equal(diff.as_subclass(torch.Tensor), plain[1:] - plain[:-1])
    rows = fast.reshape(1, -1)  # anything but 1-d iterates as a tensor does
    assert [r.tolist() for r in rows] == [values]


_TOKEN_LIKE = st.one_of(st.integers(0, 2**40), st.integers(0, 99).map(lambda t: torch.tensor(t)), st.booleans(),
                        st.floats(0, 9), st.text(max_size=2))


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(_TOKEN_LIKE, min_size=1, max_size=30), as_tuple=st.booleans())
def test_request_prompt_equals_the_per_token_check(tokens, as_tuple):
    """Request.make's prompt (plain-int lists and tuples taken whole) against a token-by-token check of the same
    values: the same ints, or the same TypeError naming the first token that is not an int."""
    prompt = tuple(tokens) if as_tuple else list(tokens)
    want: tuple | str
    try:
        want = tuple(_token("r", t) for t in tokens)
    except TypeError as err:
        want = str(err)
    try:
        got = Request.make("r", prompt).prompt
    except TypeError as err:
        got = str(err)
    assert got == want
    if not isinstance(want, str):
        assert all(type(t) is int for t in got)
