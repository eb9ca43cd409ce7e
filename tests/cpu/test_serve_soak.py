"""Fault soak of the serving engine (CPU, graphs emulated): seeded random requests with random lengths, EOS stops,
aborts of in-flight requests, invalid requests interleaved and a page budget that forces preemption. Every valid
request's tokens equal its greedy tokens alone (aborted ones: a prefix of them); every page is free at the end;
each refused request's error names why; no step raises.

Both engines soak: the overlapped one (the default: step k+1 launched before step k's tokens are read) on 2,000
requests of one seed and 300 of another, the synchronous one (``overlap=False``) on 600 and 300, fewer to keep CI
fast (its code path is the overlapped one with the read moved into the same step). ``PIECEGRAPH_SOAK=N`` makes the
first run N requests."""

import os
import random

import pytest
import serve_helpers

from piecegraph.models import TINY, generate
from piecegraph.serve import Engine, EngineConfig, SamplingParams, Status

SOAK_REQUESTS = int(os.environ.get("PIECEGRAPH_SOAK", "2000"))
# (overlap, seed, requests): about 11 s, 2 s, 3 s and 2 s on a 2-core CPU
RUNS = ((True, 0, SOAK_REQUESTS), (True, 1, 300), (False, 2, 600), (False, 1, 300))
POOL = 24  # distinct prompts: references are computed once per prompt
MAX_NEW = 12
LONGEST = 40
MAX_SEQ_LEN = 56
PAGE_SIZE = 4
NUM_PAGES = 20  # 76 tokens of pages: room for one or two long requests, so running six of them preempts


pytestmark = pytest.mark.usefixtures("one_thread")


model = serve_helpers.model  # the module-scoped TINY decoder (seed 3) the serving tests share


@pytest.fixture(scope="module")
def pool(model):
    """The prompt pool and each prompt's ``MAX_NEW`` greedy tokens alone (eager, its own cache). Greedy decoding
    is a prefix process, so the reference for ``n`` tokens and an EOS is this run cut at ``n`` and after the first
    EOS; :func:`test_the_cut_reference_is_generate_with_eos` checks that against ``generate(eos_token_id=...)``."""
    return prompt_pool(lambda prompt: generate(model, [prompt], MAX_NEW)[0])


def prompt_pool(alone):
    """``POOL`` seeded prompts and ``alone(prompt)``: its ``MAX_NEW`` greedy tokens run by itself."""
    rng = random.Random(1234)
    prompts = [[rng.randrange(TINY.vocab_size) for _ in range(rng.randint(1, LONGEST))] for _ in range(POOL)]
    return prompts, [alone(p) for p in prompts]


def _want(full, n, eos):
    tokens = full[:n]
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def test_the_cut_reference_is_generate_with_eos(model, pool):
    prompts, full = pool
    for i in (0, 5, 11):
        eos = full[i][4]
        assert generate(model, [prompts[i]], 9, eos_token_id=eos)[0] == _want(full[i], 9, eos)


def _engine(model, overlap=True, **changes):
    """The soak's engine: ``mode="auto"`` with emulated graphs and the traced pieces as they are on the CPU;
    ``changes`` replace config fields (the GPU soak: real graphs, Inductor)."""
    config = EngineConfig(mode="auto", overlap=overlap, max_num_seqs=6, max_num_batched_tokens=24, num_pages=NUM_PAGES,
                          page_size=PAGE_SIZE, max_seq_len=MAX_SEQ_LEN, decode_sizes=(1, 2, 4),
                          prefill_sizes=(1, 2, 4, 8, 16), compiler="eager", emulate_graphs=True)
    return Engine(model, config.replace(**changes))


def _invalid(rng):
    """One refused request: ``(prompt, params maker, id, exception, what the message must name)``."""
    vocab = TINY.vocab_size
    ok = SamplingParams(max_new_tokens=4)
    cases = [
        ([], ok, None, ValueError, "at least one token"),
        ([1, vocab], ok, None, ValueError, "prompt token ids .* outside the vocabulary"),
        ([-1, 2], ok, None, ValueError, "prompt token ids .* outside the vocabulary"),
        ([3] * (MAX_SEQ_LEN - 2), ok, None, ValueError, r"max_new_tokens 4\), more than the KV cache holds"),
        ([1, 2], lambda: SamplingParams(max_new_tokens=0), None, ValueError, "max_new_tokens=0"),
        ([1, 2], lambda: SamplingParams(max_new_tokens=-3), None, ValueError, "max_new_tokens=-3"),
        ([1, 2], lambda: SamplingParams(max_new_tokens=2.5), None, ValueError, "max_new_tokens=2.5"),
        ([1, 2], lambda: SamplingParams(eos_token_id="2"), None, TypeError, "eos_token_id='2'"),
        ("hello", ok, None, TypeError, "prompt must be a sequence"),
        (None, ok, None, TypeError, "prompt must be a sequence"),
        ([1, 2.5], ok, None, TypeError, "prompt token 2.5"),
        ([True, 2], ok, None, TypeError, "prompt token True"),
        ([1, "7"], ok, None, TypeError, "prompt token '7'"),
        ([1, 2], {"max_new_tokens": 4}, None, TypeError, "params must be a SamplingParams"),
        ([1, 2], ok, ["a", "list"], TypeError, "request id .* must be hashable"),
        ([1, 2], ok, ("soak", 0), ValueError, "already submitted"),
    ]
    return rng.choice(cases)


def _refuse(engine, rng):
    """Submit one invalid request: it is refused with an error naming why, and takes neither id nor pages."""
    prompt, params, rid, exc, why = _invalid(rng)
    before = (engine.cache.num_free_pages, len(engine.scheduler.waiting), len(engine._ids))
    with pytest.raises(exc, match=why):
        engine.add_request(prompt, params() if callable(params) else params, id=rid)
    assert (engine.cache.num_free_pages, len(engine.scheduler.waiting), len(engine._ids)) == before


def _abort(engine, rng, live, aborted, finished_ids):
    """Abort a random in-flight request (its pages free at once), and check abort's idempotence and KeyError."""
    victim = rng.choice(sorted(live, key=str))
    request = engine.abort(victim)
    assert request is live.pop(victim) and request.finished and request.finish_reason == "aborted"
    assert victim not in engine.cache.sequences() and request not in engine.scheduler.running
    assert request not in engine.scheduler.waiting
    aborted[victim] = request
    assert engine.abort(victim) is None  # idempotent
    if finished_ids:
        assert engine.abort(rng.choice(finished_ids)) is None
    with pytest.raises(KeyError, match="never submitted"):
        engine.abort(("never", rng.random()))


def soak(engine, pool, n_requests, seed):
    """Drive the step loop on a seeded workload; returns ``(submitted {id: (request, want)}, aborted, finished)``."""
    prompts, full = pool
    rng = random.Random(seed)
    submitted, live, aborted, finished, made = {}, {}, {}, [], 0
    while made < n_requests or engine.has_work():
        for _ in range(min(rng.choice((0, 0, 1, 1, 2, 4)), n_requests - made)):
            i, n = rng.randrange(POOL), rng.randint(1, MAX_NEW)
            eos = rng.choice((None, rng.choice(full[i]), rng.randrange(TINY.vocab_size)))
            rid = ("soak", made)
            live[rid] = engine.add_request(prompts[i], SamplingParams(max_new_tokens=n, eos_token_id=eos), id=rid)
            submitted[rid] = (live[rid], _want(full[i], n, eos))
            made += 1
            if rng.random() < 0.15:
                _refuse(engine, rng)
        if live and rng.random() < 0.04:
            _abort(engine, rng, live, aborted, [r.id for r in finished])
        for request in engine.step():  # no try: nothing may escape the step loop
            finished.append(request)
            del live[request.id]
    return submitted, aborted, finished


@pytest.mark.parametrize(("overlap", "seed", "n_requests"), RUNS)
def test_fault_soak(model, pool, overlap, seed, n_requests):
    engine = _engine(model, overlap)
    check_soak(engine, n_requests, *soak(engine, pool, n_requests, seed))


def check_soak(engine, n_requests, submitted, aborted, finished):
    """What a soak must leave (shared with the GPU soak, tests/gpu/test_serve_soak_gpu.py): every valid request
    finished once with its greedy tokens alone (aborted ones a prefix) and the right reason, every page free,
    empty queues, and steps of every kind (full, piecewise, none) with preemptions and mixed steps among them."""
    assert len(submitted) == n_requests and aborted, "the workload was meant to abort some requests"
    ids = [r.id for r in finished]
    assert len(ids) == len(set(ids)) and set(ids) | set(aborted) == set(submitted) and not set(ids) & set(aborted)
    for rid, (request, want) in submitted.items():
        assert request.status is Status.FINISHED, rid
        if rid in aborted:
            assert request.output == want[:len(request.output)], (rid, request.output, want)
        else:
            assert request.output == want, (rid, request.output, want)
            eos = request.params.eos_token_id
            assert request.finish_reason == ("eos" if eos is not None and want[-1] == eos else "length"), rid
    assert engine.cache.sequences() == [] and engine.cache.num_free_pages == engine.cache.num_pages - 1
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine._live
    assert not engine.has_work() and all(r.inflight == 0 for r, _ in submitted.values())
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["aborted"] == len(aborted)
    assert any(s.decode_rows and s.prefill_tokens for s in engine.steps), "no mixed prefill + decode step"
    assert {"full", "piecewise", "none"} <= {s.kind for s in engine.steps}


def _step_until(engine, done, ready):
    for _ in range(200):
        if ready():
            return
        done += engine.step()
    raise AssertionError("the state was never reached")


@pytest.mark.parametrize("overlap", [True, False])
def test_abort_in_every_state_frees_pages_at_once_and_keeps_the_others_tokens(model, pool, overlap):
    """Abort a waiting request, one mid-prefill (chunked), one decoding and one preempted (waiting to be
    recomputed): each leaves the queues with its pages freed at once and an ``"aborted"`` reason; the rest finish
    with their greedy tokens; a second abort is a no-op and an unknown id raises ``KeyError`` naming it."""
    prompts, full = pool
    engine = Engine(model, EngineConfig(mode="eager", max_num_seqs=4, max_num_batched_tokens=8, num_pages=14,
                                        page_size=PAGE_SIZE, max_seq_len=MAX_SEQ_LEN, overlap=overlap))
    long = max(range(POOL), key=lambda i: len(prompts[i]))
    reqs = {i: engine.add_request(prompts[i], SamplingParams(max_new_tokens=MAX_NEW), id=i) for i in range(6)}
    reqs["long"] = engine.add_request(prompts[long], SamplingParams(max_new_tokens=MAX_NEW), id="long")
    done, aborted = [], {}

    def abort(rid):
        request = engine.abort(rid)
        assert request is reqs[rid] and request.finish_reason == "aborted" and request.finished
        assert rid not in engine.cache.sequences() and request not in engine.scheduler.running
        assert request not in engine.scheduler.waiting and engine.abort(rid) is None
        aborted[rid] = request

    abort(5)  # waiting, never scheduled
    _step_until(engine, done, lambda: any(0 < r.num_computed < len(r.prompt) and r.status is Status.RUNNING
                                          for r in reqs.values() if r.id not in aborted))
    abort(next(r.id for r in reqs.values() if r.id not in aborted and 0 < r.num_computed < len(r.prompt)))
    _step_until(engine, done, lambda: any(r.preemptions and r.status is Status.WAITING for r in reqs.values()))
    abort(next(r.id for r in reqs.values() if r.preemptions and r.status is Status.WAITING))
    _step_until(engine, done, lambda: any(r.output and r.status is Status.RUNNING for r in reqs.values()))
    abort(next(r.id for r in reqs.values() if r.output and r.status is Status.RUNNING))
    with pytest.raises(KeyError, match="'nope' was never submitted"):
        engine.abort("nope")
    done += engine.run()
    assert {r.id for r in done} | set(aborted) == set(reqs) and len(aborted) == 4
    for rid, request in reqs.items():
        want = full[long if rid == "long" else rid]
        assert request.output == (want[:len(request.output)] if rid in aborted else want), rid
        if rid not in aborted:
            assert engine.abort(rid) is None  # finished: a no-op
    assert engine.cache.sequences() == [] and engine.cache.num_free_pages == engine.cache.num_pages - 1
    assert engine.stats()["aborted"] == 4
