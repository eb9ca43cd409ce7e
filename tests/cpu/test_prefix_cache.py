"""Automatic prefix caching: the hash chain, reference counts and least-recently-used eviction on a bare KV cache;
greedy tokens equal with and without the cache over random shared-prefix traffic (arrivals, aborts, eviction and
preemption on a small cache), every page free at the end; the HTTP server reports
``usage.prompt_tokens_details.cached_tokens`` and serves the same tokens."""

import functools
import random
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from piecegraph.attention.kv_cache import KVCache
from piecegraph.models import TINY, Decoder, generate
from piecegraph.serve import Engine, EngineConfig, SamplingParams
from piecegraph.serve.prefix_cache import PrefixCache
from piecegraph.serve.request import Request

pytestmark = pytest.mark.usefixtures("one_thread")

PS = 4


def _computed(cache, prefix, rid, tokens, computed=None):
    """A request that has run ``computed`` (default all) of ``tokens`` through the cache, as the scheduler leaves
    one: its cached prefix attached, the rest reserved, its full pages committed."""
    request = Request.make(rid, tokens)
    pages, entries = prefix.lookup(request)
    prefix.attach(request, pages, entries)
    cache.reserve([(rid, len(tokens))])
    request.num_computed = len(tokens) if computed is None else computed
    prefix.commit(request)
    return request


def test_hash_chain_shares_full_pages_by_prefix_and_keeps_the_last_token_computed():
    cache = KVCache(TINY, num_pages=32, page_size=PS)
    prefix = PrefixCache(cache)
    a = _computed(cache, prefix, "a", list(range(10)))  # pages [0..3] [4..7] full, [8, 9] partial
    assert len(a.prefix_entries) == 2 and prefix.num_cached == 2
    # a request with the same first 8 tokens shares both full pages; the same tokens on page 2 under another
    # first page share nothing (the chain keys pages by their prefix, not their own tokens alone)
    same = Request.make("b", list(range(8)) + [50, 51, 52])
    pages, _ = prefix.lookup(same)
    assert pages == cache.page_table("a")[:2]
    assert prefix.lookup(Request.make("c", [9, 9, 9, 9, 4, 5, 6, 7, 1]))[0] == []
    # the last-page rule: an 8-token prompt equal to the cached pages matches one page (its last token, and so
    # its whole last page, is computed again, into a page of its own); 9 tokens match both
    assert len(prefix.lookup(Request.make("d", list(range(8))))[0]) == 1
    assert len(prefix.lookup(Request.make("e", list(range(9))))[0]) == 2
    # only computed pages whose tokens the host knows are entered
    partial = _computed(cache, prefix, "p", [7] * 12, computed=5)
    assert len(partial.prefix_entries) == 1


def test_shared_pages_are_reference_counted_in_every_row_and_kept_as_free_until_evicted():
    cache = KVCache(TINY, num_pages=9, page_size=PS)  # 8 usable pages
    prefix = PrefixCache(cache)
    a = _computed(cache, prefix, "a", list(range(12)) + [99])  # 3 full pages + 1
    b = _computed(cache, prefix, "b", list(range(12)) + [77])
    shared = cache.page_table("a")[:3]
    assert cache.page_table("b")[:3] == shared and cache.page_table("b")[3] != cache.page_table("a")[3]
    assert [cache.refcount(p) for p in shared] == [2, 2, 2] and cache.num_free_pages == 8 - 5
    table = cache.device_table()
    for seq in ("a", "b"):  # a shared page appears in both rows of the device table
        assert table[cache.slot(seq), :4].tolist() == cache.page_table(seq)
    assert cache.free("a") == 4 and [cache.refcount(p) for p in shared] == [1, 1, 1]
    assert cache.num_free_pages == 4 and prefix.num_kept == 0  # a's own last page is free, not cached
    cache.free("b")
    assert cache.num_free_pages == 8 and prefix.num_kept == 3  # kept pages count as free
    assert all(cache.refcount(p) == 0 for p in range(1, 9))
    # a request matching them takes them back: they stop counting as free
    c = _computed(cache, prefix, "c", list(range(12)) + [5])
    assert cache.page_table("c")[:3] == shared and prefix.num_kept == 0 and cache.num_free_pages == 4
    cache.free("c")
    del a, b, c


def test_eviction_takes_least_recently_used_pages_tails_first_and_forgets_them():
    cache = KVCache(TINY, num_pages=9, page_size=PS)
    prefix = PrefixCache(cache)
    _computed(cache, prefix, "old", [1] * 8 + [2])  # 2 cached pages
    cache.free("old")
    _computed(cache, prefix, "new", [3] * 8 + [4])
    cache.free("new")
    assert prefix.num_kept == 4 and cache.num_free_pages == 8
    cache.reserve([("big", 6 * PS)])  # 4 free pages + 2 evicted: the older request's, its last page first
    assert prefix.num_kept == 2
    assert prefix.lookup(Request.make("x", [1] * 8 + [2]))[0] == []
    assert len(prefix.lookup(Request.make("y", [3] * 8 + [4]))[0]) == 2
    cache.reserve([("big", 7 * PS)])  # one more: the tail page of "new" goes, its first page stays matchable
    assert len(prefix.lookup(Request.make("y", [3] * 8 + [4]))[0]) == 1
    with pytest.raises(Exception, match="needs 2 more pages"):
        cache.reserve([("big2", 2 * PS)])
    cache.free("big")
    assert cache.num_free_pages == 8


def test_a_prefix_computed_twice_at_once_keeps_one_entry_and_frees_the_copy():
    cache = KVCache(TINY, num_pages=9, page_size=PS)
    prefix = PrefixCache(cache)
    a = _computed(cache, prefix, "a", [5] * 9)
    request = Request.make("b", [5] * 9)  # admitted before a committed: computes its own copy
    cache.reserve([("b", 9)])
    request.num_computed = 9
    prefix.commit(request)
    assert request.prefix_entries == a.prefix_entries and prefix.num_cached == 2
    cache.free("b")
    cache.free("a")
    assert prefix.num_kept == 2 and cache.num_free_pages == 8


# -- the engine: random shared-prefix traffic -------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return Decoder.random(TINY, seed=3).eval()


@pytest.fixture(scope="module")
def engines(model):
    """With and without the prefix cache, on caches of 15 pages of 4 tokens (56 tokens): a few requests of up to
    38 tokens evict cached pages and preempt."""
    base = dict(mode="eager", max_num_seqs=4, max_num_batched_tokens=16, page_size=PS, max_seq_len=48, num_pages=15)
    return Engine(model, EngineConfig(**base)), Engine(model, EngineConfig(**base, prefix_cache=False))


def _traffic(seed, n):
    """``n`` requests: each one of three shared prefixes (0-20 tokens, some whole pages) plus 0-9 own tokens,
    arriving at random steps, a few aborted some steps after they arrive."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(TINY.vocab_size) for _ in range(rng.choice([4, 8, 13, 20]))] for _ in range(3)]
    out = []
    for i in range(n):
        prompt = rng.choice(prefixes) + [rng.randrange(TINY.vocab_size) for _ in range(rng.randint(0, 9))]
        prompt = prompt or [1]
        abort = rng.randint(1, 6) if rng.random() < 0.2 else None
        out.append((i, rng.randint(0, 8), prompt, rng.randint(1, 6), abort))
    return out


def _serve(engine, traffic):
    """Run ``traffic`` (id, arrival step, prompt, max_new, abort after steps) through ``engine``; returns each
    request's output and whether it was aborted before it finished."""
    requests, step = {}, 0
    while step <= max(t[1] for t in traffic) or engine.has_work():
        for rid, at, prompt, new, abort in traffic:
            if at == step:
                requests[rid] = engine.add_request(prompt, SamplingParams(max_new_tokens=new))
            if abort is not None and at + abort == step and engine.abort(requests[rid].id) is not None:
                requests[rid].aborted_here = True
        engine.step()
        step += 1
    return {rid: (list(r.output), getattr(r, "aborted_here", False)) for rid, r in requests.items()}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), n=st.integers(2, 8))
def test_greedy_tokens_equal_with_and_without_the_prefix_cache(engines, seed, n):
    cached, plain = engines
    traffic = _traffic(seed, n)
    got, want = _serve(cached, traffic), _serve(plain, traffic)
    for rid in got:
        (a, cut_a), (b, cut_b) = got[rid], want[rid]
        if not (cut_a or cut_b):
            assert a == b, (rid, a, b)
        else:  # aborted at a step: each run stopped after its own number of tokens, a prefix of the same tokens
            assert a[:len(b)] == b[:len(a)], (rid, a, b)
    for engine in engines:
        cache = engine.cache
        assert not cache.sequences() and cache.num_free_pages == cache.num_pages - 1
        assert all(cache.refcount(p) == 0 for p in range(1, cache.num_pages))


def test_shared_prefixes_are_hit_preempted_requests_resume_from_cache_and_tokens_match_generate(model, engines):
    """The independent reference: each prompt alone through ``generate``. Many requests sharing a 20-token
    prefix on the small cache: most prompt tokens come from the cache, and fewer preemptions than without it."""
    cached, plain = engines
    rng = random.Random(11)
    shared = [rng.randrange(TINY.vocab_size) for _ in range(20)]
    prompts = [shared + [rng.randrange(TINY.vocab_size) for _ in range(rng.randint(1, 6))] for _ in range(8)]
    want = [generate(model, [p], 6)[0] for p in prompts]
    for engine in engines:
        engine.reset_stats()
        engine.reset_prefix_cache()
        assert engine.generate(prompts, SamplingParams(max_new_tokens=6)) == want
    stats = cached.stats()["prefix_cache"]
    assert stats["hit_rate"] > 0.5 and stats["cached_tokens"] % PS == 0
    assert plain.stats()["prefix_cache"] is None
    assert cached.stats()["preemptions"] < plain.stats()["preemptions"]


# -- the HTTP server ---------------------------------------------------------------------------------------------
httpx = pytest.importorskip("httpx")


def _post(url, path, body):
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stream_usage(url, body):
    usage, ids = None, []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True, "stream_options":
                                                             {"include_usage": True}}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                import json

                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    ids += choice.get("token_ids", [])
    return ids, usage


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
def test_server_reports_cached_prompt_tokens_and_serves_the_same_tokens(engine_process):
    """``piecegraph serve --model tiny`` on CPU (its defaults: 16-token pages, 256-token steps): a repeated
    200-token prompt finds >= 150 tokens cached, prompts sharing a 128-token prefix >= 100, streaming usage and
    chat too; every output equals an engine's without a prefix cache."""
    pytest.importorskip("fastapi")
    from piecegraph.server.command import build_engine
    from piecegraph.server.run import BackgroundServer, build_process_state, build_state
    from piecegraph.server.tokenizer import ByteTokenizer

    config = EngineConfig(mode="eager", max_num_seqs=8, max_num_batched_tokens=256, page_size=16, max_seq_len=256)
    factory = functools.partial(build_engine, "tiny", "cpu", torch.float32, False, config)
    state = (build_process_state(factory, ByteTokenizer, "tiny", drain_s=5) if engine_process
             else build_state(factory(), ByteTokenizer(), "tiny", drain_s=5))
    rng = random.Random(2)
    long = [rng.randrange(256) for _ in range(200)]
    shared = [rng.randrange(256) for _ in range(128)]
    tails = [[rng.randrange(256) for _ in range(n)] for n in (5, 30)]
    plain = Engine(Decoder.random(TINY, seed=0).eval(), config.replace(prefix_cache=False))
    want = plain.generate([long, *(shared + t for t in tails)], SamplingParams(max_new_tokens=8))
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    with BackgroundServer(state) as server:
        first = _post(server.url, "/v1/completions", {**body, "prompt": long})
        again_ids, again = _stream_usage(server.url, {**body, "prompt": long})
        assert first["choices"][0]["token_ids"] == again_ids == want[0]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["prompt_tokens"] == 200 and again["prompt_tokens_details"]["cached_tokens"] >= 150
        outs = [_post(server.url, "/v1/completions", {**body, "prompt": shared + t}) for t in tails]
        assert [o["choices"][0]["token_ids"] for o in outs] == want[1:]
        assert outs[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 100
        message = {"role": "user", "content": "piecegraph " * 20}
        chats = [_post(server.url, "/v1/chat/completions", {**body, "messages": [message]}) for _ in range(2)]
        assert chats[0]["choices"][0]["message"] == chats[1]["choices"][0]["message"]
        assert chats[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= chats[1]["usage"]["prompt_tokens"] - 16
        cached = sum(u["prompt_tokens_details"]["cached_tokens"]
                     for u in [again, *(o["usage"] for o in [first, *outs, *chats])])
        assert f"piecegraph_prompt_cached_tokens_total {cached:g}\n" in httpx.get(server.url + "/metrics").text
    loop = state.loop
    if not engine_process:
        deadline = time.monotonic() + 10
        while loop.engine.cache.num_free_pages != loop.engine.cache.num_pages - 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert loop.engine.cache.num_free_pages == loop.engine.cache.num_pages - 1


def test_serve_bench_shared_prefix_workload_reports_hit_rate_and_ttft_with_and_without(tmp_path):
    """``serve-bench --workload shared-prefix``: by default the auto row beside auto-noprefix, each with its hit
    rate (what the requests' prefill skipped, counted from the engine's requests) and TTFT; the same requests."""
    import json

    from typer.testing import CliRunner

    from piecegraph.cli import app
    from piecegraph.serve.bench import Workload

    out = tmp_path / "shared.json"
    result = CliRunner().invoke(app, [
        "serve-bench", "--device", "cpu", "--model", "tiny", "--workload", "shared-prefix", "--prefix-len", "64",
        "--num-prefixes", "2", "--concurrency", "2", "--requests", "6", "--input-len", "8", "--output-len", "4",
        "--compiler", "eager", "--warmup", "1", "--no-reference", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"auto", "auto-noprefix"} and "prefix hit" in result.output
    on, off = rows["auto"], rows["auto-noprefix"]
    assert on["prefix_cache"] and not off["prefix_cache"]
    assert off["cached_tokens"] == 0 and off["prefix_hit_rate"] == 0
    # two prefixes of 64 tokens (4 pages of 16): each of the 6 requests but the first of each prefix (and those
    # running beside it before its prefill was launched) finds its prefix's pages
    assert on["cached_tokens"] % 16 == 0 and on["cached_tokens"] >= 2 * 64
    assert on["prompt_tokens"] == off["prompt_tokens"] and on["ttft_p50_ms"] > 0 and off["ttft_p50_ms"] > 0
    work = Workload(8, 4, 0.25, 0, 64, 2).requests(4, 256)
    assert work[0][0][:64] == work[2][0][:64] != work[1][0][:64]
