"""The MLA split op (``piecegraph_models::mla_attention``) on the torch backend, against a float64 reference that
never absorbs: it expands every cached latent into per-head keys ``[W_UK c | kpe]`` and values ``W_UV c`` and runs
plain causal softmax attention per sequence; DSA by masking all but each query's top-k index scores.

The op gets the absorbed query (``q_nope @ W_UK``) and returns the latent output; the test applies ``W_UV``.
"""

from __future__ import annotations

import random
import sys
import warnings
from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import piecegraph.attention.mla_op  # noqa: F401  (registers torch.ops.piecegraph_models.mla_attention)
from piecegraph.attention import AttentionMetadata, KVCache
from piecegraph.context import forward_context

pytestmark = pytest.mark.usefixtures("one_thread")  # two shared cores: one torch thread each

H, R, P, DN, DV = 3, 16, 8, 12, 10  # heads, latent, rotary, query/key nope head, value head
HI, DI = 4, 8  # indexer heads and dim
SCALE = (DN + P) ** -0.5


@dataclass(frozen=True)
class Shape:
    """An MLA cache shape as the interface describes it (what the models stage's config exposes)."""

    num_layers: int = 2
    num_heads: int = H
    num_kv_heads: int = 1
    head_dim: int = R
    v_head_dim: int = P
    index_head_dim: int = DI
    max_seq_len: int = 64
    attention_backend: str = "torch"
    mla: bool = True


class Model:
    """Random per-layer up-projections and per-token inputs; the float64 reference, expanded per head."""

    def __init__(self, seed: int, layers: int = 2) -> None:
        g = torch.Generator().manual_seed(seed)
        self.g = g
        self.w_uk = torch.randn(layers, H, DN, R, generator=g, dtype=torch.float64) / R ** 0.5
        self.w_uv = torch.randn(layers, H, DV, R, generator=g, dtype=torch.float64) / R ** 0.5
        self.seen: dict = {}  # (seq, layer) -> dict of per-token float64 tensors, in position order

    def tokens(self, n: int) -> dict:
        """One layer's inputs for n new tokens. The indexer's keys and heads 1.. of its queries are positive, so
        index scores are continuous (no ties at the top-k boundary); head 0 has both signs (relu matters)."""
        g, f = self.g, torch.float64
        iq = torch.rand(n, HI, DI, generator=g, dtype=f) + 0.05
        iq[:, 0] = torch.randn(n, DI, generator=g, dtype=f)
        return {"q_nope": torch.randn(n, H, DN, generator=g, dtype=f),
                "q_pe": torch.randn(n, H, P, generator=g, dtype=f),
                "ckv": torch.randn(n, R, generator=g, dtype=f), "kpe": torch.randn(n, P, generator=g, dtype=f),
                "iq": iq, "iw": torch.rand(n, HI, generator=g, dtype=f) + 0.1,
                "ik": torch.rand(n, DI, generator=g, dtype=f) + 0.05}

    def reference(self, seqs, inputs: dict, layer: int, topk: int, chosen: dict) -> torch.Tensor:
        """Expanded attention ``[n, H, DV]`` of the step's tokens; ``chosen`` maps (seq, position) to the
        index-selected keys: filled when this layer has an indexer, read when it reuses (``inputs['iq']`` None)."""
        out, row = [], 0
        for seq, cached, new in seqs:
            hist = self.seen.setdefault((seq, layer), {})
            for name, t in inputs.items():
                if t is not None:
                    hist[name] = torch.cat([hist[name], t[row:row + new]]) if name in hist else t[row:row + new]
            keys_nope = torch.einsum("hdr,lr->lhd", self.w_uk[layer], hist["ckv"])
            keys = torch.cat([keys_nope, hist["kpe"][:, None].expand(-1, H, -1)], dim=-1)  # [L, H, DN + P]
            values = torch.einsum("hdr,lr->lhd", self.w_uv[layer], hist["ckv"])
            for i in range(new):
                pos = cached + i
                q = torch.cat([hist["q_nope"][pos], hist["q_pe"][pos]], dim=-1)  # [H, DN + P]
                visible = torch.arange(pos + 1)
                if topk and inputs["iq"] is not None:
                    dots = torch.relu(torch.einsum("hd,ld->hl", hist["iq"][pos], hist["ik"][:pos + 1]) * DI ** -0.5)
                    score = hist["iw"][pos] @ dots
                    chosen[seq, pos] = score.argsort(descending=True)[:topk] if pos + 1 > topk else visible
                if topk:
                    visible = chosen[seq, pos]
                s = torch.einsum("hd,lhd->hl", q, keys[visible]) * SCALE
                out.append(torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), values[visible]))
            row += new
        return torch.stack(out)


def _cache(seed: int, page_size: int = 4, num_pages: int = 80, **shape) -> KVCache:
    cache = KVCache(Shape(**shape), num_pages, page_size)
    random.Random(seed).shuffle(cache._free)  # pages out of order
    for t in (*cache.k, *cache.v, *cache.index_k):
        t.normal_()  # garbage in unwritten slots: never read
    return cache


def _op(cache, meta, model, inputs, layer, topk, pad, indexer: bool) -> torch.Tensor:
    """The op on padded float32 rows; returns W_UV applied to its latent output ``[n, H, DV]`` (float64)."""
    n = meta.num_tokens

    def padded(t):
        return torch.cat([t, torch.randn(pad, *t.shape[1:], dtype=t.dtype)]).float()

    q_abs = torch.einsum("thd,hdr->thr", inputs["q_nope"], model.w_uk[layer])  # absorbed
    out = torch.full((n + pad, H, R), float("nan"))
    index = dict(index_q=padded(inputs["iq"]), index_weights=padded(inputs["iw"]), index_k=padded(inputs["ik"]),
                 index_scale=DI ** -0.5) if indexer else {}
    with forward_context(meta):
        torch.ops.piecegraph_models.mla_attention(padded(q_abs), padded(inputs["q_pe"]), padded(inputs["ckv"]),
                                                  padded(inputs["kpe"]), out, layer, SCALE, topk, **index)
    assert (out[n:] == 0).all(), "pad rows must come out zero"
    return torch.einsum("thr,hdr->thd", out[:n].double(), model.w_uv[layer])


def _run(steps, seed: int, topk: int, page_size: int = 4, pad: int = 2, backend=None, graph: int = 0) -> None:
    """Run ``steps`` (lists of (seq, new tokens)) through both layers: layer 0 with its indexer (when topk),
    layer 1 reusing layer 0's selection; compare each with the reference. ``backend``: a backend class to put in
    the cache's place; ``graph``: decode steps run on ``meta.for_cuda_graph(n + graph)`` (full-graph metadata)."""
    cache, model, lengths = _cache(seed, page_size), Model(seed), {}
    if backend is not None:
        cache.backend = backend(cache.config, "cpu")
    for step in steps:
        seqs = [(seq, lengths.get(seq, 0), new) for seq, new in step]
        meta = AttentionMetadata.for_batch(cache, seqs)
        n, chosen = meta.num_tokens, {}
        if graph and meta.is_decode:
            meta, pad = meta.for_cuda_graph(n + graph), 0
        for layer in range(2):
            inputs = model.tokens(n)
            indexer = bool(topk) and layer == 0
            if not indexer:
                inputs.update(iq=None, iw=None, ik=None)
            if meta.num_tokens > n:  # a graph's pad rows: garbage inputs, outputs not compared
                inputs = {k: None if v is None else torch.cat([v, torch.randn(meta.num_tokens - n, *v.shape[1:],
                                                                              dtype=v.dtype)])
                          for k, v in inputs.items()}
            got = _op(cache, meta, model, inputs, layer, topk, pad, indexer)[:n]
            want = model.reference(seqs, {k: None if v is None else v[:n] for k, v in inputs.items()}, layer, topk,
                                   chosen)
            torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-5)
        for seq, cached, new in seqs:
            lengths[seq] = cached + new


def test_dense_mla_mixed_prefill_chunks_and_decode():
    _run([[("a", 9), ("b", 1)], [("a", 1), ("b", 6), ("c", 13)], [("a", 1), ("b", 1), ("c", 1)],
          [("c", 5), ("a", 1)]], seed=0, topk=0)


def test_dsa_selects_topk_of_a_prompt_longer_than_topk_then_decodes():
    # topk 8 of a 40-token prompt (dense below 9 keys, sparse above), then decode steps beside a second prompt
    _run([[("p", 40)], [("p", 1), ("q", 12)], [("p", 1), ("q", 1)], [("p", 1), ("q", 3)]], seed=1, topk=8)


def test_small_score_budget_slices_batches_and_queries_with_equal_results(monkeypatch):
    from piecegraph.attention.backends import torch_mla

    monkeypatch.setattr(torch_mla, "SCORE_BUDGET", 200)  # one row, and a few queries, per slice
    _run([[("p", 19), ("q", 1), ("r", 1)], [("p", 1), ("q", 7), ("r", 1)], [("p", 1), ("q", 1), ("r", 1)]],
         seed=4, topk=6)


def test_dsa_topk_at_least_the_context_equals_dense():
    steps = [[("a", 7), ("b", 3)], [("a", 1), ("b", 1)]]
    cache_dense, cache_dsa = _cache(2), _cache(2)
    results = []
    for cache, topk in ((cache_dense, 0), (cache_dsa, 16)):
        model, lengths, outs = Model(2), {}, []
        for step in steps:
            seqs = [(seq, lengths.get(seq, 0), new) for seq, new in step]
            meta = AttentionMetadata.for_batch(cache, seqs)
            inputs = model.tokens(meta.num_tokens)
            outs.append(_op(cache, meta, model, inputs, 0, topk, 0, indexer=bool(topk)))
            lengths.update({s: c + n for s, c, n in seqs})
        results.append(outs)
    for dense, sparse in zip(*results):
        torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-6)


@settings(max_examples=12, deadline=None)
@given(layout=st.lists(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 9)), min_size=1, max_size=4),
                       min_size=1, max_size=3),
       topk=st.sampled_from([0, 3, 6]), page_size=st.sampled_from([1, 4, 16]), seed=st.integers(0, 99),
       pad=st.integers(0, 2))
def test_op_equals_reference_over_random_layouts(layout, topk, page_size, seed, pad):
    steps, lengths = [], {}
    for raw in layout:  # distinct sequences per step, within max_seq_len
        step, seen = [], set()
        for seq, new in raw:
            if seq not in seen and lengths.get(seq, 0) + new <= 64:
                seen.add(seq)
                step.append((seq, new))
                lengths[seq] = lengths.get(seq, 0) + new
        steps.append(step)
    _run([s for s in steps if s], seed, topk, page_size, pad)


@settings(max_examples=40, deadline=None)
@given(context=st.integers(4, 40), topk=st.integers(1, 12), queries=st.integers(1, 3),
       page_size=st.sampled_from([4, 16]), zeros=st.integers(0, 8), seed=st.integers(0, 999))
def test_dsa_choice_among_tied_scores_does_not_depend_on_page_padding(context, topk, queries, page_size, zeros,
                                                                     seed):
    """Index scores tie exactly where ReLU zeroes every head (``zeros`` keys here). The choice over a page-padded
    width equals ``topk`` over the exact context, the tensor transformers scores, whatever the page size."""
    from piecegraph.attention.backends.torch_mla import _select

    assume(context - queries + 1 > topk)  # fewer causal keys than topk: all are chosen, padding fills the rest
    gen = torch.Generator().manual_seed(seed)
    iq, w = torch.randn(1, queries, HI, DI, generator=gen), torch.rand(1, queries, HI, 1, generator=gen)
    keys = torch.randn(1, context, DI, generator=gen)
    tied = torch.randperm(context, generator=gen)[:zeros]
    keys[0, tied] = 0.0  # every head's dot is 0, so is the ReLU-weighted score: exact ties
    positions = torch.arange(context)
    causal = torch.where(positions[None, :] <= context - queries + torch.arange(queries)[:, None], 0.0, -torch.inf)
    width = -(-context // page_size) * page_size + page_size  # rounded up to pages, and one page more
    padded_keys = torch.cat([keys, torch.randn(1, width - context, DI, generator=gen)], dim=1)
    padded_mask = torch.cat([causal, torch.full((queries, width - context), -torch.inf)], dim=1)
    got = _select(iq, w, padded_keys, padded_mask[None, :, None], topk, 0.5)
    want = _select(iq, w, keys, causal[None, :, None], topk, 0.5)
    assert torch.equal(got, want)
    scores = (torch.relu(torch.einsum("qhd,ld->qhl", iq[0], keys[0]) * 0.5) * w[0]).sum(1) + causal
    assert torch.equal(want[0], scores.topk(min(topk, context), dim=-1).indices)  # topk over the exact context


def test_refusals_name_the_argument():
    cache, model = _cache(0), Model(0)
    meta = AttentionMetadata.for_batch(cache, [("a", 0, 3)])
    inputs = model.tokens(3)
    with pytest.raises(ValueError, match="reuses the DSA selection"):
        _op(cache, meta, model, inputs, 1, 4, 0, indexer=False)
    with pytest.raises(ValueError, match="topk=0"):
        _op(cache, meta, model, inputs, 0, 0, 0, indexer=True)
    q, out = torch.zeros(3, H, R), torch.zeros(3, H, R)
    with pytest.raises(ValueError, match="layer 5 is out of range"), forward_context(meta):
        torch.ops.piecegraph_models.mla_attention(q, q[:, :, :P], q[:, 0], q[:, 0, :P], out, 5, SCALE)
    with pytest.raises(ValueError, match="mla_attention"):
        with forward_context(meta):
            cache.backend.forward(None, None, None, None, 0, meta)
    plain = _cache(0, index_head_dim=0)
    meta = AttentionMetadata.for_batch(plain, [("a", 0, 3)])
    with pytest.raises(ValueError, match="no indexer key cache"):
        _op(plain, meta, model, inputs, 0, 2, 0, indexer=True)


class FakeMLAWrapper:
    """FlashInfer 0.5.3's ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` signature and semantics (its
    ``mla.py``): int32 index tensors, host reads of qo_indptr / kv_indptr / kv_len_arr at plan time, ``run``
    reading pages through ``kv_indices`` (the graph buffer in CUDA-graph mode), causal aligned bottom-right."""

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None, backend="auto"):
        self._graph, self._kv_indices_buf = use_cuda_graph, kv_indices
        self._bufs = (qo_indptr, kv_indptr, kv_len_arr)

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe,
             page_size, causal, sm_scale, q_data_type, kv_data_type, use_profiler=False):
        for t in (qo_indptr, kv_indptr, kv_indices, kv_len_arr):
            assert t.dtype == torch.int32
        assert (head_dim_ckv, head_dim_kpe, causal) == (R, P, True)
        self._host = [t.to("cpu").clone() for t in (qo_indptr, kv_indptr, kv_len_arr)]
        if self._graph:
            for buf, t in zip(self._bufs, (qo_indptr, kv_indptr, kv_len_arr)):
                buf.copy_(t)
            self._kv_indices_buf[: len(kv_indices)].copy_(kv_indices)
        else:
            self._kv_indices_buf = kv_indices
        self._page_size, self._sm_scale, self._plan_info = page_size, sm_scale, [len(kv_len_arr)]

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None):
        qo, kv, lens = self._host
        for b in range(len(lens)):
            pages = self._kv_indices_buf[int(kv[b]):int(kv[b + 1])].long()
            length, lo, hi = int(lens[b]), int(qo[b]), int(qo[b + 1])
            c, k = ckv_cache[pages].flatten(0, 1)[:length], kpe_cache[pages].flatten(0, 1)[:length]
            s = (torch.einsum("qhr,lr->qhl", q_nope[lo:hi], c) + torch.einsum("qhp,lp->qhl", q_pe[lo:hi], k))
            rows = torch.arange(hi - lo)[:, None, None] + length - (hi - lo)
            s = (s * self._sm_scale).masked_fill(torch.arange(length) > rows, float("-inf"))
            out[lo:hi] = torch.einsum("qhl,lr->qhr", torch.softmax(s, dim=-1), c)
        return out


@pytest.fixture
def fake_flashinfer_mla(monkeypatch):
    import types

    fi, mla = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper, fi.mla, fi.__version__ = FakeMLAWrapper, mla, "0.5.3+fake"
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)


@pytest.mark.parametrize("topk", [0, 8])
def test_flashinfer_mla_backend_plans_what_its_kernel_reads(fake_flashinfer_mla, topk):
    """Dense layers through the (stand-in) FlashInfer MLA wrapper, eager and in full-graph decode metadata;
    DSA layers through its torch path (said once)."""
    from piecegraph.attention.backends.flashinfer_mla import FlashInferMLABackend

    steps = [[("p", 20), ("q", 1)], [("p", 1), ("q", 9)], [("p", 1), ("q", 1)], [("p", 1), ("q", 1)]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(steps, seed=3, topk=topk, backend=FlashInferMLABackend, graph=2)
    assert bool(topk) == any("torch gather path" in str(w.message) for w in caught)


def test_flashinfer_mla_runs_dsa_steps_within_topk_on_its_dense_kernel(fake_flashinfer_mla, monkeypatch):
    """A DSA layer's eager step whose sequences hold at most topk keys runs the (stand-in) FlashInfer kernel, equal
    to the reference; the step after, with a longer sequence, runs the torch path (said); a full graph's decode
    metadata always does."""
    from piecegraph.attention.backends.flashinfer_mla import FlashInferMLABackend

    kernel_rows = []
    real_run = FakeMLAWrapper.run
    monkeypatch.setattr(FakeMLAWrapper, "run", lambda self, qn, *a, **k: (kernel_rows.append(qn.shape[0]),
                                                                          real_run(self, qn, *a, **k))[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run([[("p", 7), ("q", 3)], [("p", 1), ("q", 1)]], seed=5, topk=8, backend=FlashInferMLABackend)
    assert kernel_rows == [10, 10, 2, 2] and not any("torch gather path" in str(w.message) for w in caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run([[("p", 8)], [("p", 1)]], seed=5, topk=8, backend=FlashInferMLABackend)
    assert any("torch gather path" in str(w.message) for w in caught)  # 9 keys > topk 8 in the second step
    kernel_rows.clear()
    _run([[("p", 3)], [("p", 1)]], seed=6, topk=8, backend=FlashInferMLABackend, graph=2)
    assert kernel_rows == [3, 3]  # the prefill only: the graph's decode step takes the torch path
    kernel_rows.clear()
    _run([[("p", 3)], [("p", 1)]], seed=6, topk=64, backend=FlashInferMLABackend, graph=2)
    assert kernel_rows == [3, 3, 3, 3]  # no sequence of the cache can exceed topk: graphs run the kernel too


@dataclass(frozen=True)
class SharedShape(Shape):
    """GLM-5's layout: layer 1 reuses layer 0's DSA choice and keeps no index keys."""

    layer_indexer_types: tuple = ("full", "shared")


def test_index_tensors_for_a_layer_that_keeps_no_index_keys_are_refused():
    cache, model = KVCache(SharedShape(), 20, 4), Model(0)
    assert cache.index_k[0].numel() and not cache.index_k[1].numel()
    meta = AttentionMetadata.for_batch(cache, [("a", 0, 3)])
    with pytest.raises(ValueError, match="layer 1: index tensors were given, but the cache keeps no indexer keys"):
        _op(cache, meta, model, model.tokens(3), 1, 2, 0, indexer=True)
