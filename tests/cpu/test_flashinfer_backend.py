"""The FlashInfer backend's own logic on CPU: page layout, cache writes, padding for full graphs, stale plans.

FlashInfer itself needs a GPU, so these tests swap in ``fakes/fake_flashinfer.py`` (FlashInfer 0.5.3's
signatures, its documented CSR semantics, loops in float32) and compare the backend with the torch backend, an
independent implementation, in float32. Whether the real kernels match is the GPU suite's job
(tests/gpu/test_attention_gpu.py).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import piecegraph
from piecegraph.attention import AttentionMetadata, KVCache
from piecegraph.context import forward_context
from piecegraph.models import TINY, Decoder, generate

CFG = TINY.replace(num_heads=6, num_kv_heads=2, head_dim=8)


pytestmark = pytest.mark.usefixtures("fake_flashinfer")


def _caches(num_pages=120, page_size=4, seed=0, config=CFG, max_seq_len=64):
    """A torch-backend cache and a FlashInfer-backend one with equal contents and equally shuffled pages."""
    from piecegraph.attention.backends.flashinfer import FlashInferBackend

    caches = []
    for _ in range(2):
        cache = KVCache(config, num_pages, page_size, max_seq_len=max_seq_len, backend="torch")
        random.Random(seed).shuffle(cache._free)
        gen = torch.Generator().manual_seed(seed)
        for k, v in zip(cache.k, cache.v):
            k.normal_(generator=gen)
            v.normal_(generator=gen)
        caches.append(cache)
    caches[1].backend = FlashInferBackend(config, "cpu")
    return caches


def _op(cache, meta, q, k, v, layer=0, pad=0):
    rows = meta.num_tokens + pad
    out = torch.full((rows, q.shape[1]), float("nan"))
    pad_rows = [torch.cat([x, torch.randn(pad, x.shape[1])]) for x in (q, k, v)]
    with forward_context(meta):
        torch.ops.piecegraph_models.attention(*pad_rows, out, layer)
    assert (out[meta.num_tokens:] == 0).all()
    return out[: meta.num_tokens]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@settings(max_examples=15, deadline=None)
@given(steps=st.lists(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 7)), min_size=1, max_size=5),
                      min_size=1, max_size=3),
       page_size=st.sampled_from([1, 4, 16]), seed=st.integers(0, 999), pad=st.integers(0, 2))
def test_flashinfer_backend_equals_torch_backend_over_mixed_steps(steps, page_size, seed, pad):
    caches, lengths = _caches(page_size=page_size, seed=seed), {}
    gen = torch.Generator().manual_seed(seed)
    for step in steps:
        seqs, seen = [], set()
        for seq, new in step:
            if seq not in seen and lengths.get(seq, 0) + new <= 64:
                seen.add(seq)
                seqs.append((seq, lengths.get(seq, 0), new))
        n = sum(new for _, _, new in seqs)
        q, k, v = (torch.randn(n, h * CFG.head_dim, generator=gen) for h in (6, 2, 2))
        ref, got = (_op(c, AttentionMetadata.for_batch(c, seqs), q, k, v, pad=pad) for c in caches)
        assert _rel(got, ref) < 1e-5
        for seq, cached, new in seqs:
            lengths[seq] = cached + new
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        assert torch.equal(a[1:], b[1:])  # the same slots written, the same values; page 0 is scratch


@settings(max_examples=25, deadline=None)
@given(prefixes=st.lists(st.integers(1, 20), min_size=2, max_size=4),
       steps=st.lists(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 3)), min_size=1, max_size=4),
                      min_size=2, max_size=4),
       runs=st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.integers(0, 2)), min_size=1, max_size=8),
       seed=st.integers(0, 999))
def test_metadata_built_ahead_attends_right_in_any_run_order(prefixes, steps, runs, seed):
    """Plans are lazy and a wrapper holds one plan: steps built ahead, then run in any order, repeated, eagerly
    or through a full graph's padded view (decode steps), each attend as the torch backend does."""
    caches = _caches(seed=seed, page_size=4)
    for cache in caches:
        cache.reserve([(i, n) for i, n in enumerate(prefixes)])
    gen = torch.Generator().manual_seed(seed)
    built = []
    for step in steps:
        rows, seen = [], set()
        for seq, new in step:
            seq %= len(prefixes)
            if seq not in seen:
                seen.add(seq)
                rows.append((seq, prefixes[seq], 1 if len(step) > 2 else new))
        n = sum(new for _, _, new in rows)
        qkv = [torch.randn(n, h * CFG.head_dim, generator=gen) for h in (6, 2, 2)]
        built.append(([AttentionMetadata.for_batch(c, rows) for c in caches], qkv))
    for index, via_graph, pad in runs:
        (torch_meta, fi_meta), qkv = built[index % len(built)]
        want = _op(caches[0], torch_meta, *qkv)
        if via_graph and fi_meta.is_decode:  # the view is the padded batch: pad rows are its own rows
            n = fi_meta.num_tokens
            padded = [torch.cat([x, torch.randn(pad, x.shape[1], generator=gen)]) for x in qkv]
            got = _op(caches[1], fi_meta.for_cuda_graph(n + pad), *padded)[:n]
        else:
            got = _op(caches[1], fi_meta, *qkv)
        assert _rel(got, want) < 1e-5, (index, via_graph, pad)


def test_full_graph_decode_pads_onto_the_scratch_page_and_equals_torch():
    """Emulated full graphs of size 8 for 3 sequences: pad rows must write and read only the scratch page."""
    model = Decoder.random(CFG, seed=1)
    outs = []
    for cache in _caches(seed=2):
        AttentionMetadata.for_batch(cache, [(i, 0, 5 + i) for i in range(3)])
        graphed = piecegraph.compile(model, mode="full", compiler="eager", capture_sizes=(8,), emulate_graphs=True)
        for step in range(3):
            meta = AttentionMetadata.for_decode(cache, [(i, 5 + i + step) for i in range(3)])
            with forward_context(meta), torch.no_grad():
                outs.append((cache, graphed(torch.tensor([3, 1, 4]), meta.positions)))
        assert graphed.stats()["replays"] == 2
    torch_outs, fi_outs = outs[:3], outs[3:]
    for (_, a), (_, b) in zip(torch_outs, fi_outs):
        assert _rel(b, a) < 1e-5
    for a, b in zip(torch_outs[0][0].k, fi_outs[0][0].k):  # later layers' k carry rounding of earlier ones
        assert _rel(b[1:], a[1:]) < 1e-6


@pytest.mark.parametrize("heads, kv_heads, tensor_cores", [(6, 2, False), (8, 2, False), (14, 2, True)])
def test_greedy_generation_with_flashinfer_graphs_equals_torch_eager(heads, kv_heads, tensor_cores):
    """Groups of up to 4 query heads per KV head decode on the plain kernel, larger ones on tensor cores (the
    fake refuses a group the plain kernel lacks, as FlashInfer does), eagerly and in full graphs alike."""
    config = CFG.replace(num_heads=heads, num_kv_heads=kv_heads)
    model = Decoder.random(config, seed=4)
    prompts = [[5, 6, 7, 8, 9], [1, 2], [40, 41, 42]]
    torch_cache, fi_cache = _caches(seed=5, config=config)
    expected = generate(model, prompts, 10, cache=torch_cache)
    prefill = piecegraph.compile(model, mode="piecewise", compiler="eager", max_tokens=16, emulate_graphs=True)
    decode = piecegraph.compile(model, mode="full", compiler="eager", capture_sizes=(4,), emulate_graphs=True)
    assert generate(model, prompts, 10, cache=fi_cache, prefill_fn=prefill, decode_fn=decode) == expected
    assert decode.stats()["replays"] == 8
    backend = fi_cache.backend
    wrappers = [backend._decode.wrapper] + [g.plan.slot.wrapper for g in backend._graphs.values()]
    assert len(wrappers) == 2 and all(w._use_tensor_cores == tensor_cores for w in wrappers)


def test_a_stale_plan_is_replanned_not_reused():
    torch_cache, fi_cache = _caches(seed=6)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(7, h * CFG.head_dim, generator=gen) for h in (6, 2, 2))
    want = _op(torch_cache, AttentionMetadata.for_batch(torch_cache, [(0, 0, 4), (1, 0, 3)]), q, k, v)
    step_a = AttentionMetadata.for_batch(fi_cache, [(0, 0, 4), (1, 0, 3)])
    step_b = AttentionMetadata.for_batch(fi_cache, [(2, 0, 6), (3, 0, 2)])
    assert _rel(_op(fi_cache, step_a, q, k, v), want) < 1e-5  # its first call plans (lazily): not a re-plan
    qb, kb, vb = (torch.randn(8, h * CFG.head_dim, generator=gen) for h in (6, 2, 2))
    _op(fi_cache, step_b, qb, kb, vb)  # replaces the prefill wrapper's plan
    assert fi_cache.backend.replans == 0
    assert _rel(_op(fi_cache, step_a, q, k, v), want) < 1e-5
    assert fi_cache.backend.replans == 1


def test_a_full_graph_step_never_plans_the_eager_wrapper_nor_builds_a_page_table():
    # The eager plan is lazy: a decode step that replays a full graph reads only for_cuda_graph's metadata, so
    # the eager decode wrapper's plan() (65-690 us on the H200) and its page layout are never paid for.
    _, fi_cache = _caches(seed=7)
    fi_cache.reserve([(0, 9), (1, 5)])
    meta = AttentionMetadata.for_decode(fi_cache, [(0, 8), (1, 4)])
    assert meta.is_decode and meta.page_table is None
    view = meta.for_cuda_graph(4)
    assert view.plan.graph and view.slot_mapping.shape == (4,) and view.slot_mapping[2:].eq(0).all()  # pad rows
    assert meta.plan.kv_indptr is None and fi_cache.backend._decode.holds is None


def test_a_first_attention_call_under_capture_is_refused_naming_the_fix(monkeypatch):
    # The lazy plan runs on the host at a step's first call; inside a capture it could not, so it says so.
    _, fi_cache = _caches()
    meta = AttentionMetadata.for_batch(fi_cache, [(0, 0, 3)])
    monkeypatch.setattr(fi_cache.backend, "_capturing", lambda: True)
    q, k, v = (torch.randn(3, h * CFG.head_dim) for h in (6, 2, 2))
    with forward_context(meta), pytest.raises(RuntimeError, match="run the step once before capturing it"):
        torch.ops.piecegraph_models.attention(q, k, v, torch.empty_like(q), 0)


def test_forward_refuses_a_dtype_the_cache_was_not_planned_for():
    _, fi_cache = _caches()
    meta = AttentionMetadata.for_batch(fi_cache, [(0, 0, 3)])
    q, k, v = (torch.randn(3, h * CFG.head_dim, dtype=torch.float64) for h in (6, 2, 2))
    with forward_context(meta), pytest.raises(ValueError, match="q is torch.float64 but the KV cache is torch.float32"):
        torch.ops.piecegraph_models.attention(q, k, v, torch.empty_like(q), 0)


# The engine tests' settings: small sizes, so that steps meet full graphs, piecewise graphs and preemption.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, page_size=4, max_seq_len=32, decode_sizes=(1, 2, 4),
              prefill_sizes=(4, 8, 16), compiler="eager", emulate_graphs=True)


def _engine_case(model_seed, prompt_seed, new):
    """A model, six random prompts, each one's torch eager greedy tokens alone (``new`` of them), and a 12-page
    cache on the FlashInfer backend for the engine."""
    from piecegraph.attention.backends.flashinfer import FlashInferBackend

    model = Decoder.random(CFG, seed=model_seed).eval()
    rng = random.Random(prompt_seed)
    prompts = [[rng.randrange(CFG.vocab_size) for _ in range(rng.randint(1, 20))] for _ in range(6)]
    want = [generate(model, [p], new)[0] for p in prompts]
    cache = KVCache(CFG, 12, 4, max_seq_len=32, backend="torch")
    cache.backend = FlashInferBackend(CFG, "cpu")
    return model, prompts, want, cache


@pytest.mark.parametrize("overlap, mixed_graphs", [(True, True), (False, True), (True, False)])
def test_the_engine_on_flashinfer_plans_at_most_once_per_step_and_equals_torch(overlap, mixed_graphs):
    """The serving engine (auto: full graphs for decode, full-mixed graphs for steps with prompt tokens or, with
    ``mixed_graphs=False``, piecewise ones; preemption) on the FlashInfer backend: every request's tokens equal
    torch eager greedy decoding alone, and each step plans a wrapper once (the eager one lazily, or the graph
    size's), which the step stats report."""
    from piecegraph.serve import Engine, EngineConfig, SamplingParams

    model, prompts, want, cache = _engine_case(model_seed=1, prompt_seed=4, new=6)
    engine = Engine(model, EngineConfig(mode="auto", overlap=overlap, mixed_graphs=mixed_graphs, **ENGINE),
                    cache=cache)
    cache.backend.plans = 0  # capture planned each size once
    assert engine.generate(prompts, SamplingParams(max_new_tokens=6)) == want
    stats = engine.stats()
    other = "full-mixed" if mixed_graphs else "piecewise"
    assert stats["preemptions"] > 0 and set(stats["by_kind"]) == {"full", other}
    assert all(s.plans == 1 for s in engine.steps) and stats["max_plans_per_step"] == 1
    assert cache.backend.plans == len(engine.steps) and all(s.plan_s > 0 for s in engine.steps)


def test_graph_workspace_bytes_match_what_flashinfer_asked_for_on_the_h200():
    """FlashInfer 0.5.3 refused a 1024-row graph plan of the Qwen1.5-MoE-A2.7B shape (16/16 heads of 128) on an
    H200 (132 SMs): "batch_prefill_tmp_v with size 142475264 ... only 134217728 bytes available". The estimate
    holds that tmp_v, its tmp_s and their alignment, and the 0.5B shape (14/2 heads of 64), which always fit in
    the default 128 MiB, still fits."""
    from piecegraph.attention.backends.flashinfer import WORKSPACE_BYTES, graph_workspace_bytes

    tmp_v = 142475264
    tmp_s = tmp_v // 128
    assert graph_workspace_bytes(16, 16, 128, 1024, 132) == tmp_v + tmp_s + 32
    assert graph_workspace_bytes(14, 2, 64, 1024, 132) < WORKSPACE_BYTES
    # few rows: the grid floor of two CTAs per SM per KV head sets the tiles
    assert graph_workspace_bytes(16, 16, 128, 1, 132) == 16 * 16 * 16 * 129 * 4 + 32


def test_engines_sharing_a_flashinfer_cache_alternate_and_equal_torch():
    """serve-bench --interleave's sharing: an auto and a piecewise engine on one FlashInfer cache (one set of
    per-size graph wrappers and eager wrappers, planned by whichever engine steps), their batches alternating:
    every request's tokens equal torch eager greedy decoding alone."""
    from piecegraph.serve import Engine, EngineConfig, SamplingParams

    model, prompts, want, cache = _engine_case(model_seed=2, prompt_seed=6, new=5)
    auto = Engine(model, EngineConfig(mode="auto", **ENGINE), cache=cache)
    piecewise = Engine(model, EngineConfig(mode="piecewise", **ENGINE), cache=cache)
    for engine in (auto, piecewise, auto, piecewise):
        assert engine.generate(prompts, SamplingParams(max_new_tokens=5)) == want
    assert "full" in auto.stats()["by_kind"] and cache.num_free_pages == cache.num_pages - 1
