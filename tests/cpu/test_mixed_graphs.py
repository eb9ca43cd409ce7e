"""Auto's full-mixed graphs on CPU: steps with prompt tokens replayed as full graphs on FlashInfer's CUDA-graph
prefill wrapper (``flashinfer_mixed.py``), through ``fakes/fake_flashinfer.py`` (its graph-mode ``run`` reads the
query and page layout from the wrapper's fixed buffers only, as captured kernels do) and emulated graphs.

The reference is independent: each request's greedy tokens from torch eager attention, alone (for a transformers
model, its own ``generate``). Random traffic (arrivals while others decode, preemption, slots fewer than a step's
sequences) must give those tokens whichever module ran each step, and free every page."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from piecegraph.attention import AttentionMetadata, KVCache
from piecegraph.models import TINY, Decoder, generate
from piecegraph.models.generate import dummy_mixed_inputs
from piecegraph.serve import Engine, EngineConfig, SamplingParams

CFG = TINY.replace(num_heads=6, num_kv_heads=2, head_dim=8)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, page_size=4, max_seq_len=32, decode_sizes=(1, 2, 4),
              prefill_sizes=(4, 8, 16), compiler="eager", emulate_graphs=True)


pytestmark = pytest.mark.usefixtures("fake_flashinfer")


def _flashinfer_cache(num_pages: int) -> KVCache:
    from piecegraph.attention.backends.flashinfer import FlashInferBackend

    cache = KVCache(CFG, num_pages, 4, max_seq_len=32, backend="torch")
    cache.backend = FlashInferBackend(CFG, "cpu")
    return cache


def _serve(engine: Engine, prompts: list[list[int]], new: int, arrive_every: int) -> list[list[int]]:
    """The first two prompts at once, then one more every ``arrive_every`` steps (arrivals beside decode rows)."""
    params = SamplingParams(max_new_tokens=new)
    requests = [engine.add_request(p, params) for p in prompts[:2]]
    waiting, steps = list(prompts[2:]), 0
    while engine.has_work() or waiting:
        if waiting and steps % arrive_every == 0:
            requests.append(engine.add_request(waiting.pop(0), params))
        engine.step()
        steps += 1
    return [list(r.output) for r in requests]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), slots=st.integers(1, 4), pages=st.integers(9, 30), overlap=st.booleans(),
       arrive_every=st.integers(1, 4))
def test_random_traffic_through_mixed_graphs_gives_each_requests_eager_tokens(monkeypatch, seed, slots, pages,
                                                                              overlap, arrive_every):
    """Steps with prompt tokens replay full-mixed graphs when they have at most ``slots`` sequences and piecewise
    graphs otherwise; with pages short enough to preempt, every request's tokens equal torch eager greedy decoding
    alone, and every page is free at the end."""
    from piecegraph.attention.backends import flashinfer_mixed

    monkeypatch.setattr(flashinfer_mixed, "MIXED_GRAPH_SEQS", slots)
    rng = random.Random(seed)
    model = Decoder.random(CFG, seed=seed % 7).eval()
    prompts = [[rng.randrange(CFG.vocab_size) for _ in range(rng.randint(1, 20))] for _ in range(5)]
    new = rng.randint(2, 6)
    want = [generate(model, [p], new)[0] for p in prompts]
    cache = _flashinfer_cache(pages)
    engine = Engine(model, EngineConfig(mode="auto", overlap=overlap, **ENGINE), cache=cache)
    assert _serve(engine, prompts, new, arrive_every) == want
    for step in engine.steps:  # the dispatch: prompt steps that fit the slots on full-mixed graphs, others piecewise
        if not step.is_decode:
            assert step.kind == ("full-mixed" if step.seqs <= slots else "piecewise"), step
    assert cache.num_free_pages == cache.num_pages - 1 and cache.sequences() == []


def test_a_step_with_more_sequences_than_the_graphs_slots_is_refused_not_truncated():
    """The backend never replays a step its graph has no slots for: it raises, naming piecewise; the engine's
    dispatch sends such steps to the piecewise module before that."""
    cache = _flashinfer_cache(40)
    meta = AttentionMetadata.for_batch(cache, [(i, 0, 2) for i in range(5)])  # 10 tokens over 5 sequences
    backend = cache.backend
    backend.mixed_graph_seqs = lambda size: 4
    with pytest.raises(ValueError, match="piecewise"):
        meta.for_cuda_graph(16)


def test_the_torch_backend_refuses_a_full_graph_of_a_mixed_step():
    cache = KVCache(CFG, 20, 4, max_seq_len=32, backend="torch")
    meta = AttentionMetadata.for_batch(cache, [("a", 0, 3), ("b", 0, 1)])
    with pytest.raises(ValueError, match="mode='piecewise'"):
        meta.for_cuda_graph(8)


@pytest.mark.parametrize("n, seqs", [(2, 1), (4, 4), (16, 4), (48, 64)])
def test_mixed_capture_inputs_are_a_prompt_step_of_exactly_n_tokens_on_the_scratch_page(n, seqs):
    """What a full-mixed size is captured on: ``n`` tokens over at most ``seqs`` sequences, not a decode step
    (a decode step would take the decode graphs' path), every slot on the scratch page."""
    cache = _flashinfer_cache(20)
    (ids, positions), meta = dummy_mixed_inputs(CFG, cache, n, seqs)
    assert ids.shape == positions.shape == (n,) and meta.num_tokens == n
    assert not meta.is_decode and meta.layout.num_seqs <= min(seqs, n - 1)
    assert set(meta.slot_mapping.div(cache.page_size, rounding_mode="floor").tolist()) == {0}
    assert cache.sequences() == []


def test_a_full_mixed_capture_that_fails_leaves_prompt_steps_piecewise_with_a_warning(monkeypatch, caplog):
    """The full-mixed module is an optimization: a capture error there (a kernel that cannot be captured at a
    prompt's size, say) must not stop the engine. It warns, naming the error, and serves prompt steps piecewise;
    the tokens stay torch eager's."""
    from piecegraph.attention.backends import flashinfer_mixed

    def refuse(self, meta, size):
        raise RuntimeError("no graph of this step")

    monkeypatch.setattr(flashinfer_mixed.MixedGraphs, "_mixed_for_cuda_graph", refuse)
    model = Decoder.random(CFG, seed=2).eval()
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5]]
    want = [generate(model, [p], 4)[0] for p in prompts]
    with caplog.at_level("WARNING", logger="piecegraph"):
        engine = Engine(model, EngineConfig(mode="auto", **ENGINE), cache=_flashinfer_cache(30))
    assert engine.executor.prefill is None and "no graph of this step" in caplog.text
    assert engine.generate(prompts, SamplingParams(max_new_tokens=4)) == want
    assert set(engine.stats()["by_kind"]) == {"full", "piecewise"}


def test_auto_times_a_prompt_beside_decode_rows_and_frees_what_it_took(monkeypatch):
    """``time_mixed``: each timed step is its own metadata of ``n`` tokens, up to 8 decode rows (each with cached
    context) beside prompt chunks of at most ``max_seq_len - 1`` tokens, within the graph's slots; too few free
    pages give ``None`` (the rule stands); the cache ends as it began."""
    from piecegraph.serve import executor

    model = Decoder.random(CFG, seed=3).eval()
    engine = Engine(model, EngineConfig(mode="auto", **ENGINE), cache=_flashinfer_cache(40))
    cache, built = engine.cache, []
    for_batch = executor.AttentionMetadata.for_batch
    monkeypatch.setattr(executor.AttentionMetadata, "for_batch",
                        lambda c, seqs: built.append(list(seqs)) or for_batch(c, seqs))
    ms = executor.time_mixed(engine.executor.prefill.module, model, cache, 16, 4, overlap=True, repeats=2)
    assert ms is not None and ms > 0 and built
    for seqs in built:
        decode = [s for s in seqs if s[2] == 1 and s[1] > 0]
        prompts = [s for s in seqs if s[1] == 0]
        assert len(decode) == 3 and sum(n for _, _, n in seqs) == 16 and len(seqs) <= 4
        assert all(n <= cache.max_seq_len - 1 for _, _, n in prompts)
    assert cache.sequences() == [] and cache.num_free_pages == cache.num_pages - 1
    small = Engine(model, EngineConfig(mode="auto", **ENGINE), cache=_flashinfer_cache(6))
    assert executor.time_mixed(small.executor.prefill.module, model, small.cache, 16, 4) is None
    assert small.cache.num_free_pages == small.cache.num_pages - 1


def test_a_transformers_model_through_full_mixed_graphs_gives_transformers_tokens():
    """``piecegraph.hf``'s wrapper of an unmodified transformers Qwen2 in the auto engine on the (fake)
    FlashInfer backend: prompt steps replay full-mixed graphs, and the greedy tokens equal transformers' own
    ``generate``, one prompt at a time."""
    pytest.importorskip("transformers")
    from hf_reference import transformers_greedy
    from hf_tiny import BASE, init_all_matrices_fan_in, random_causal_lm, sized_config

    import piecegraph.hf as pghf
    from piecegraph.attention.backends.flashinfer import FlashInferBackend

    net = random_causal_lm(sized_config("qwen2", **{**BASE, "eos_token_id": None}), init_all_matrices_fan_in)
    prompts = [[5, 17, 3, 99, 42, 7, 8, 9], [7, 7, 1], [100, 13, 54, 2, 8, 31, 4, 4, 4, 5, 6]]
    want = [transformers_greedy(net, p, 8, eos=set()) for p in prompts]
    with pghf.HFDecoder(net) as wrapped:
        cache = KVCache(wrapped.config, 40, 4, max_seq_len=32, backend="torch")
        cache.backend = FlashInferBackend(wrapped.config, "cpu")
        engine = Engine(wrapped, EngineConfig(mode="auto", **ENGINE), cache=cache)
        assert engine.generate(prompts, SamplingParams(max_new_tokens=8)) == want
    assert engine.stats()["by_kind"].get("full-mixed", 0) > 0


def test_mixed_capture_inputs_refuse_a_cache_of_another_model_and_a_single_token():
    cache = _flashinfer_cache(20)
    with pytest.raises(ValueError, match="different model shape"):
        dummy_mixed_inputs(CFG.replace(num_kv_heads=3, num_heads=6), cache, 8, 4)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        dummy_mixed_inputs(CFG, cache, 1, 4)


def test_mixed_graphs_is_a_bool_and_auto_nomixed_turns_it_off():
    from piecegraph.serve.sweep import engine_config

    assert EngineConfig().mixed_graphs and not engine_config("auto-nomixed", EngineConfig()).mixed_graphs
    assert engine_config("auto-nomixed", EngineConfig()).mode == "auto"
    with pytest.raises(ValueError, match="EngineConfig.mixed_graphs=1 must be True or False"):
        EngineConfig(mixed_graphs=1)
