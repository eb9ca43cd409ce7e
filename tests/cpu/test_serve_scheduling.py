"""The scheduler and sampling. Property-tested on ``Arithmetic`` (its next token a known function of token and
position): any arrivals, budgets and page sizes lose nothing, keep the budgets and return every page; the closed
loop keeps its concurrency. Nucleus (top-p) sampling keeps exactly the most likely tokens reaching top_p, against a
float64 reference, and ``SamplingParams.top_p`` is checked."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_helpers import Arithmetic

from piecegraph.models import TINY, Decoder, generate
from piecegraph.serve import Engine, EngineConfig, SamplingParams
from piecegraph.serve.bench import Workload, closed_loop

pytestmark = pytest.mark.usefixtures("one_thread")


requests_st = st.lists(st.tuples(st.lists(st.integers(0, Arithmetic.V - 1), min_size=1, max_size=24),
                                 st.integers(1, 10), st.integers(0, 12)), min_size=1, max_size=10)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests_st, budget=st.integers(1, 24), seqs=st.integers(1, 5), page_size=st.integers(1, 6),
       spare=st.integers(0, 6))
def test_scheduler_loses_nothing_and_returns_every_page(reqs, budget, seqs, page_size, spare):
    longest = max(len(p) + n for p, n, _ in reqs)
    pages = -(-longest // page_size) + spare + 1  # the longest request fits alone, barely
    engine = Engine(Arithmetic(), EngineConfig(mode="eager", max_num_seqs=seqs, max_num_batched_tokens=budget,
                                               num_pages=pages, page_size=page_size, max_seq_len=64))
    pending = sorted(enumerate(reqs), key=lambda x: x[1][2])  # (index, (prompt, max_new, arrival step))
    submitted, finished, step = {}, [], 0
    while pending or engine.has_work():
        while pending and pending[0][1][2] <= step:
            i, (prompt, n, _) = pending.pop(0)
            submitted[i] = engine.add_request(prompt, SamplingParams(max_new_tokens=n), id=i)
        finished += engine.step()
        step += 1
        assert step < 2000, "the engine stopped making progress"
    assert sorted(r.id for r in finished) == list(range(len(reqs)))
    for i, (prompt, n, _) in enumerate(reqs):
        assert submitted[i].output == Arithmetic.expect(prompt, n)
    assert engine.cache.sequences() == [] and engine.cache.num_free_pages == pages - 1
    assert all(s.tokens <= budget and s.seqs <= seqs for s in engine.steps)


def test_closed_loop_keeps_the_concurrency():
    engine = Engine(Arithmetic(), EngineConfig(mode="eager", max_num_seqs=8, max_num_batched_tokens=32,
                                               max_seq_len=64))
    work = Workload(input_len=10, output_len=6, range_ratio=0.5, seed=1).requests(9, Arithmetic.V)
    done = closed_loop(engine, work, concurrency=3)
    assert len(done) == 9 and max(s.seqs for s in engine.steps) == 3
    assert [len(r.output) for r in sorted(done, key=lambda r: r.id[1])] == [n for _, n in work]


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(2, 40), seed=st.integers(0, 2**16), top_p=st.floats(0.01, 1.0), spread=st.floats(0.1, 8.0))
def test_nucleus_keeps_exactly_the_most_likely_tokens_reaching_top_p(vocab, seed, top_p, spread):
    from piecegraph.serve.sampling import nucleus

    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * spread, -1)
    kept = nucleus(probs, top_p)
    # float64 reference, one token at a time: walk the tokens from the most likely, stop once the mass reaches top_p
    order, mass, want = sorted(range(vocab), key=lambda i: -float(probs[i])), 0.0, set()
    for i in order:
        if mass >= top_p:
            break
        want.add(i)
        mass += float(probs[i])
    assert {i for i in range(vocab) if kept[i] > 0} == want
    assert torch.equal(kept[sorted(want)], probs[sorted(want)])


def test_top_p_samples_only_inside_the_nucleus_and_is_checked():
    model = Decoder.random(TINY, seed=2).eval()
    engine = Engine(model, EngineConfig(mode="eager", max_num_seqs=4, max_num_batched_tokens=64, max_seq_len=64))
    tiny_p = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=6, temperature=1.0, seed=3,
                                                                top_p=1e-9))
    assert tiny_p == generate(model, [[1, 2, 3], [4, 5]], 6)  # a nucleus of one token: the argmax
    for bad in (0, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="SamplingParams.top_p"):
            SamplingParams(top_p=bad)
