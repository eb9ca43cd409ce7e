"""Overlapped steps: the engine launches step k+1 before it reads step k's tokens, which become step k+1's input
ids on the device. Its tokens must equal the synchronous engine's (``overlap=False``) and each request's tokens
alone, for any mix of arrivals, EOS stops, lengths, aborts, seeded sampling and preemption; a stopped request runs
one extra decode row, never emitted; pages all come back."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_helpers import Arithmetic

from piecegraph.models import TINY, Decoder, generate
from piecegraph.serve import Engine, EngineConfig, SamplingParams, Status

pytestmark = pytest.mark.usefixtures("one_thread")


def _arith_engine(overlap, budget=8, seqs=3, page_size=2, pages=12):
    return Engine(Arithmetic(), EngineConfig(mode="eager", max_num_seqs=seqs, max_num_batched_tokens=budget,
                                             num_pages=pages, page_size=page_size, max_seq_len=64, overlap=overlap))


def _drive(engine, script):
    """Run ``script`` = ``[(prompt, params, arrival step, abort step or None)]`` step by step; returns the
    requests by index and the indices actually aborted (those still live at their abort step). What each step
    says it emitted (``engine.emitted``, what a server publishes) must add up to every request's output, aborted
    ones included, one token per request per step, each finished request with its last token in that step."""
    requests, aborted, step, finished, streams = {}, set(), 0, [], {}
    while len(requests) < len(script) or engine.has_work():
        for i, (prompt, params, arrival, _) in enumerate(script):
            if arrival == step:
                requests[i] = engine.add_request(prompt, params, id=i)
        for i, (_, _, _, abort) in enumerate(script):
            if abort == step and i in requests and engine.abort(i) is not None:
                aborted.add(i)
        done = engine.step()
        got, tokens = engine.emitted
        assert len(got) == len(tokens) == len({r.id for r in got})
        assert {r.id for r in done} <= {r.id for r in got}
        for request, token in zip(got, tokens):
            streams.setdefault(request.id, []).append(token)
            assert request.output[len(streams[request.id]) - 1] == token
        finished += done
        step += 1
        assert step < 3000, "the engine stopped making progress"
    ids = [r.id for r in finished]
    assert len(ids) == len(set(ids)) and set(ids) | aborted == set(requests) and not set(ids) & aborted
    assert engine.cache.sequences() == [] and engine.cache.num_free_pages == engine.cache.num_pages - 1
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert all(r.status is Status.FINISHED and r.inflight == 0 for r in requests.values())
    assert all(streams.get(i, []) == r.output for i, r in requests.items())
    return requests, aborted


def _check_against(reference, requests, aborted):
    for i, request in requests.items():
        want = reference[i].output
        if i in aborted:
            assert request.finish_reason == "aborted" and request.output == want[:len(request.output)], i
        else:
            assert (request.output, request.finish_reason) == (want, reference[i].finish_reason), i


script_st = st.lists(st.tuples(
    st.lists(st.integers(0, Arithmetic.V - 1), min_size=1, max_size=20),  # prompt
    st.integers(1, 9),  # max_new_tokens
    st.integers(0, 10),  # arrival step
    st.one_of(st.none(), st.integers(0, 8)),  # EOS: None, or the index of the greedy token that is the EOS
    st.sampled_from([0.0, 0.0, 0.7]),  # temperature (seeded sampling)
    st.one_of(st.none(), st.none(), st.integers(0, 25)),  # abort step
), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=script_st, budget=st.integers(1, 16), seqs=st.integers(1, 4), page_size=st.integers(1, 4),
       spare=st.integers(0, 4), seed=st.integers(0, 99))
def test_overlapped_tokens_equal_synchronous_tokens(raw, budget, seqs, page_size, spare, seed):
    """The synchronous engine without aborts is the reference (its greedy rows checked against the arithmetic
    model's known tokens); the synchronous and the overlapped engine with aborts must match it."""
    script, plain = [], []
    for prompt, n, arrival, eos_at, temperature, abort in raw:
        greedy = Arithmetic.expect(prompt, n)
        eos = greedy[eos_at] if eos_at is not None and eos_at < n and temperature == 0 else None
        if eos is None and eos_at is not None:
            eos = eos_at * 11 % Arithmetic.V  # a sampled row may or may not meet it
        params = SamplingParams(max_new_tokens=n, temperature=temperature, seed=seed, eos_token_id=eos)
        script.append((prompt, params, arrival, abort))
        plain.append((prompt, params, arrival, None))
    longest = max(len(p) + n for p, n, *_ in raw)
    pages = -(-longest // page_size) + spare + 1  # the longest fits alone: small budgets preempt

    def engine(overlap):
        return _arith_engine(overlap, budget, seqs, page_size, pages)

    reference, _ = _drive(engine(False), plain)
    for i, (prompt, params, _, _) in enumerate(plain):
        request = reference[i]
        if params.greedy:
            want = Arithmetic.expect(prompt, params.max_new_tokens)
            eos = params.eos_token_id
            assert request.output == (want[:want.index(eos) + 1] if eos in want else want)
    for overlap in (False, True):
        requests, aborted = _drive(engine(overlap), script)
        _check_against(reference, requests, aborted)
    overlapped, _ = _drive(engine(True), plain)
    _check_against(reference, overlapped, set())


def test_tokens_reach_the_host_one_step_later_when_overlapped():
    prompt = [5, 6, 7]
    want = Arithmetic.expect(prompt, 4)
    for overlap, lag in ((False, 0), (True, 1)):
        engine = _arith_engine(overlap)
        request = engine.add_request(prompt, SamplingParams(max_new_tokens=4))
        seen = []
        while engine.has_work():
            engine.step()
            seen.append(len(request.output))
        assert request.output == want
        assert seen == [0] * lag + [1, 2, 3, 4], (overlap, seen)  # one step per token, the last read lag later


def test_a_stopped_request_runs_one_discarded_row_and_frees_its_pages():
    """EOS at the 2nd token: the overlapped engine has already launched the 3rd row when it learns the EOS; that
    row's token is never emitted, the request's pages are freed once, and a request at max_new_tokens runs no
    extra row (its length is known on the host)."""
    prompt = [1, 2, 3, 4, 5]
    greedy = Arithmetic.expect(prompt, 6)
    rows = {}
    for overlap in (False, True):
        engine = _arith_engine(overlap, budget=16, page_size=4)
        schedule = engine.scheduler.schedule

        def counting(schedule=schedule, overlap=overlap):
            batch = schedule()
            for r in batch.rows:
                rows[overlap, r.request.id] = rows.get((overlap, r.request.id), 0) + 1
            return batch

        engine.scheduler.schedule = counting
        stop = engine.add_request(prompt, SamplingParams(max_new_tokens=6, eos_token_id=greedy[1]), id="eos")
        full = engine.add_request(prompt, SamplingParams(max_new_tokens=3), id="len")
        engine.run()
        assert stop.output == greedy[:2] and stop.finish_reason == "eos"
        assert full.output == greedy[:3] and full.finish_reason == "length"
        assert engine.cache.num_free_pages == engine.cache.num_pages - 1
    assert (rows[False, "eos"], rows[True, "eos"]) == (2, 3)  # prefill + 1 decode; overlapped: + 1 discarded
    assert rows[False, "len"] == rows[True, "len"] == 3


def test_abort_while_a_step_is_in_flight_discards_its_token():
    engine = _arith_engine(True)
    request = engine.add_request([3, 4], SamplingParams(max_new_tokens=5), id="a")
    other = engine.add_request([9], SamplingParams(max_new_tokens=5), id="b")
    engine.step()  # both prefills launched; their first tokens are still in flight
    assert request.output == [] and request.inflight == 1
    assert engine.abort("a") is request and "a" not in engine.cache.sequences()
    done = engine.run()
    assert request.output == [] and request.finish_reason == "aborted" and done == [other]
    assert other.output == Arithmetic.expect([9], 5)
    assert engine.cache.num_free_pages == engine.cache.num_pages - 1


@pytest.fixture(scope="module")
def model():
    return Decoder.random(TINY, seed=3).eval()


def test_overlapped_engine_on_the_reference_decoder_equals_synchronous_and_alone(model):
    """Graphs emulated (full for decode, piecewise otherwise), chunked prefill, preemption, seeded sampling and
    EOS: the overlapped engine's tokens equal the synchronous engine's, and greedy ones each request alone."""
    rng = random.Random(7)
    prompts = [[rng.randrange(TINY.vocab_size) for _ in range(rng.randint(1, 30))] for _ in range(8)]
    alone = [generate(model, [p], 8)[0] for p in prompts]
    params = [SamplingParams(max_new_tokens=8, temperature=0.8 if i % 3 == 0 else 0.0, seed=i,
                             eos_token_id=alone[i][4] if i % 3 == 1 else None) for i in range(len(prompts))]
    outs = {}
    for overlap in (False, True):
        config = EngineConfig(mode="auto", max_num_seqs=4, max_num_batched_tokens=16, num_pages=15, page_size=4,
                              max_seq_len=48, decode_sizes=(1, 2), prefill_sizes=(1, 2, 4, 8), compiler="eager",
                              emulate_graphs=True, overlap=overlap)
        engine = Engine(model, config)
        outs[overlap] = engine.generate(prompts, params)
        assert engine.stats()["preemptions"] > 0 and {"full", "piecewise"} <= {s.kind for s in engine.steps}
        assert engine.cache.num_free_pages == engine.cache.num_pages - 1
    assert outs[True] == outs[False]
    for i, got in enumerate(outs[True]):
        if params[i].greedy:
            want = alone[i]
            eos = params[i].eos_token_id
            assert got == (want[:want.index(eos) + 1] if eos in want else want)
