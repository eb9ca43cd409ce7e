"""The OpenAI-compatible server with the official ``openai`` client on loopback, one auto-mode server shared by
every test here: greedy outputs (completions and chat, streaming and not, 32 concurrent clients) equal
``Engine.generate`` of the same prompts token for token, and so do seeded and top-p samples with the same params;
stop strings and stop token ids; every bad input gets its status and names its field; /v1/models and /metrics
(the engine loop's time by phase, each first token's time split between the engine and the server); a bounded load
loop loses nothing; the engine loop survives all of it."""

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import serve_helpers
from server_helpers import MAX_SEQ_LEN, NEW, TOK, completion, httpx, openai_client, text_prompts, wait_all_pages_free

from piecegraph.serve import Engine, EngineConfig, SamplingParams
from piecegraph.serve.stats import PHASES
from piecegraph.server.run import BackgroundServer, build_state

pytestmark = pytest.mark.usefixtures("one_thread")


model = serve_helpers.model  # the module-scoped TINY decoder (seed 3) the serving tests share


@pytest.fixture(scope="module")
def reference(model):
    """``Engine.generate`` on a separate eager engine: the independent reference for every greedy output."""
    engine = Engine(model, EngineConfig(mode="eager", max_num_seqs=64, max_num_batched_tokens=512, page_size=8,
                                        max_seq_len=MAX_SEQ_LEN))

    def generate(prompts, max_new=NEW):
        return engine.generate(prompts, SamplingParams(max_new_tokens=max_new))

    return generate


@pytest.fixture(scope="module")
def server(model):
    """The server under test: mode auto (full graphs for decode, piecewise otherwise, emulated on CPU)."""
    config = EngineConfig(mode="auto", max_num_seqs=8, max_num_batched_tokens=64, page_size=8,
                          max_seq_len=MAX_SEQ_LEN, decode_sizes=(1, 2, 4, 8), prefill_sizes=(8, 16, 32, 64),
                          compiler="eager", emulate_graphs=True)
    state = build_state(Engine(model, config), TOK, "tiny", max_pending=64, drain_s=5)
    with BackgroundServer(state) as running:
        yield running


def test_completions_32_concurrent_clients_equal_engine_generate(server, reference):
    prompts = text_prompts(32, seed=1)
    ids_prompts = [TOK.encode(p) for p in prompts]
    want = reference(ids_prompts)
    # Half stream, half not; every fourth sends token ids instead of text.
    jobs = [(ids_prompts[i] if i % 4 == 3 else prompts[i], i % 2 == 0) for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda job: completion(server.url, *job), jobs))
    for i, (text, ids, reason) in enumerate(got):
        assert ids == want[i], (i, jobs[i])
        assert text == TOK.decode(want[i])
        assert reason == "length"
    assert wait_all_pages_free(server.state.loop.engine)


def _chat(url, messages, stream):
    client = openai_client(url)
    if not stream:
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=NEW, temperature=0, seed=7)
        return r.choices[0].message.content, r.usage.completion_tokens, r.usage.prompt_tokens
    text, usage = "", None
    for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=NEW, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
    return text, usage.completion_tokens, usage.prompt_tokens


def test_chat_streaming_and_not_equal_engine_generate(server, reference):
    conversations = [[{"role": "user", "content": p}] for p in text_prompts(8, seed=2)]
    conversations.append([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    # The byte tokenizer's template, written out here independently of its code.
    rendered = ["".join(f"<|{m['role']}|>\n{m['content']}\n" for m in c) + "<|assistant|>\n" for c in conversations]
    want = reference([list(r.encode()) for r in rendered])
    jobs = [(c, i % 2 == 0) for i, c in enumerate(conversations)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: _chat(server.url, *job), jobs))
    for (text, completion_tokens, prompt_tokens), w, r in zip(got, want, rendered):
        assert text == TOK.decode(w)
        assert completion_tokens == len(w) and prompt_tokens == len(r.encode())


def test_stop_strings_and_stop_token_ids(server, reference):
    prompt = "stop here"
    want = reference([TOK.encode(prompt)], max_new=24)[0]
    full = TOK.decode(want)
    stop = full[5:7]
    at = full.find(stop)
    client = openai_client(server.url)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:at] and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=stop, stream=True) if c.choices)
    assert streamed == full[:at]
    cut = want.index(want[6])
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"stop_token_ids": [want[6]], "return_token_ids": True})
    assert r.choices[0].token_ids == want[:cut + 1] and r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == TOK.decode(want[:cut])
    assert wait_all_pages_free(server.state.loop.engine)


BAD = [  # (body, status, the field the message must name)
    (b"{not json", 400, "JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"model": "tiny", "prompt": "x", "foo": 1}, 400, "foo"),
    ({"model": "gpt-9", "prompt": "x"}, 400, "model"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x" * 200}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 500}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "temperature": 2.5}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": "tiny", "prompt": "x", "n": 2}, 400, "n"),
    ({"model": "tiny", "prompt": "x", "seed": -1}, 400, "seed"),
    ({"model": "tiny", "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": "tiny", "prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ({"model": "tiny", "prompt": "x", "stop": ["a", ""]}, 400, "stop"),
    ({"model": "tiny", "prompt": "x", "stop_token_ids": [999]}, 400, "stop_token_ids"),
    ({"model": "tiny", "prompt": [300, 1]}, 400, "prompt"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt"),
    ({"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt"),
    ({"model": "tiny", "prompt": [1.5]}, 400, "prompt"),
]


BAD_CHAT = [
    ({"model": "tiny", "messages": []}, 400, "messages"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x", "x": 1}]}, 400, "messages.0.x"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": []}, 400, "tools"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x" * 200}]}, 400, "messages"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 999}, 400,
     "max_completion_tokens"),
]


@pytest.mark.parametrize("path,body,status,field", [("/v1/completions", *case) for case in BAD]
                         + [("/v1/chat/completions", *case) for case in BAD_CHAT])
def test_bad_input_gets_its_status_naming_the_field(server, path, body, status, field):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=data, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert field in error["message"] and error["type"] == "invalid_request_error", error
    if field[0].islower() and field != "JSON object":
        assert error["param"] == field or error["message"].startswith(field)


def test_engine_loop_survives_bad_inputs_and_unknown_routes(server, reference):
    assert httpx.get(server.url + "/v1/nope").json()["error"]["message"]
    for body in (b"\xff\xfe", b"null", b'{"model": "tiny", "prompt": {"a": 1}}', b"{" * 10_000):
        assert httpx.post(server.url + "/v1/completions", content=body).status_code == 400
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text, ids, _ = completion(server.url, "still alive", stream=False)
    assert ids == reference([TOK.encode("still alive")])[0]


def test_models_and_metrics(server):
    models = openai_client(server.url).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    completion(server.url, "metrics", stream=True)
    text = httpx.get(server.url + "/metrics").text
    for series in ("piecegraph_requests_total", "piecegraph_prompt_tokens_total", "piecegraph_requests_waiting",
                   "piecegraph_time_to_first_token_seconds_count", "piecegraph_inter_token_latency_seconds_bucket",
                   "piecegraph_kv_pages_used", "piecegraph_kv_pages_total"):
        assert series in text
    assert 'piecegraph_engine_steps_total{kind="full"}' in text
    assert 'piecegraph_engine_steps_total{kind="piecewise"}' in text
    assert 'piecegraph_requests_total{finish_reason="length"}' in text
    # where the engine loop's time goes: its steps' phases add up to the engine's own per-step records, read once
    # the loop is idle (a step still in flight is recorded, and its seconds added, one loop iteration later)
    metrics, engine = server.state.metrics, server.state.loop.engine

    def loop_seconds() -> dict[str, float]:
        return {p: metrics.value("piecegraph_engine_loop_seconds_total", part=p) for p in ("step", "publish", "idle")}

    deadline, before = time.monotonic() + 10, None
    while time.monotonic() < deadline:
        now = (len(engine.steps), loop_seconds()["step"], engine.has_work())
        if now == before and not now[2]:
            break
        before = now
        time.sleep(0.05)
    steps, parts = list(engine.steps), loop_seconds()
    for i, phase in enumerate(PHASES):
        want = sum(s.phases[i] for s in steps)
        assert metrics.value("piecegraph_engine_step_phase_seconds_total", phase=phase) == pytest.approx(want), phase
    launched = sum(sum(s.phases[:3]) for s in steps)  # measured inside the loop's step() calls
    assert parts["step"] >= launched and parts["publish"] > 0 and parts["idle"] > 0, (parts, launched)


def test_metrics_split_each_first_token_between_the_engine_and_the_server(server):
    """Per first token the engine adds its own part of the TTFT (request taken to first token on the host), which
    can only be part of the server's (arrival at the route to first token sent): ``serve-bench --url`` prints
    both, so a TTFT gap between HTTP and the in-process engine is placed on the engine or around it."""
    from piecegraph.serve.http_bench import engine_counters, engine_share

    metrics = server.state.metrics

    def sums():
        hist = metrics.snapshot()["hists"]["piecegraph_time_to_first_token_seconds"]
        return (metrics.value("piecegraph_engine_time_to_first_token_seconds_total"),
                metrics.value("piecegraph_engine_first_tokens_total"), hist[1], hist[2])

    scraped, before = engine_counters(server.url), sums()
    for i in range(3):
        completion(server.url, f"ttft split {i}", stream=True)
    after, now = engine_counters(server.url), sums()
    engine_s, firsts, server_s, served = (a - b for a, b in zip(now, before))
    assert firsts == served == 3
    assert 0 < engine_s <= server_s
    split = engine_share(scraped, after, 1.0)["ttft_mean_ms"]
    assert split["engine"] == pytest.approx(1e3 * engine_s / 3, rel=1e-3, abs=1e-3)
    assert split["server"] == pytest.approx(1e3 * server_s / 3, rel=1e-3, abs=1e-3)


async def _load(url, prompts, limit_s):
    """Clients in a closed loop: streaming and not, some leaving early, some invalid; returns outcomes by index."""
    out, todo = {}, list(enumerate(prompts))
    async with httpx.AsyncClient(base_url=url, timeout=limit_s, limits=httpx.Limits(max_connections=40)) as client:

        async def one(i, prompt):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
            if i % 17 == 0:
                body["temperature"] = 9  # invalid: a 400, and the loop goes on
            if i % 2:
                r = await client.post("/v1/completions", json=body)
                return r.status_code, r.json()["choices"][0]["token_ids"] if r.status_code == 200 else None
            body["stream"] = True
            ids = []
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return r.status_code, None
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        ids += json.loads(line[6:])["choices"][0]["token_ids"]
                        if i % 13 == 0:
                            return "left", None  # leaves mid-stream: closing the response aborts it
            return 200, ids

        async def worker():
            while todo:
                i, prompt = todo.pop()
                out[i] = await one(i, prompt)

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(32))), limit_s)
    return out


def test_bounded_load_loop_loses_no_request(server, reference):
    prompts = [TOK.encode(p) for p in text_prompts(300, seed=4)]
    want = reference(prompts, max_new=6)
    start = time.monotonic()
    out = asyncio.run(_load(server.url, prompts, limit_s=45))
    assert time.monotonic() - start < 45
    assert sorted(out) == list(range(len(prompts)))  # every request answered
    for i, (status, ids) in out.items():
        if i % 17 == 0:
            assert status == 400
        elif status != "left":
            assert status == 200 and ids == want[i], i
    assert wait_all_pages_free(server.state.loop.engine)
    assert httpx.get(server.url + "/health").status_code == 200


def test_seeded_sampling_equals_the_engine_with_the_same_params(server, model):
    engine = Engine(model, EngineConfig(mode="eager", max_num_seqs=4, page_size=8, max_seq_len=MAX_SEQ_LEN))
    prompt = TOK.encode("sample me")
    want = engine.generate([prompt], SamplingParams(max_new_tokens=NEW, temperature=0.8, seed=5))[0]
    client = openai_client(server.url)
    for stream in (False, True):
        kwargs = dict(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0.8, seed=5,
                      extra_body={"return_token_ids": True})
        if stream:
            ids = [i for c in client.completions.create(stream=True, **kwargs) for i in c.choices[0].token_ids]
        else:
            ids = client.completions.create(**kwargs).choices[0].token_ids
        assert ids == want


def test_top_p_reaches_the_engine_and_equals_it_with_the_same_params(server, model):
    engine = Engine(model, EngineConfig(mode="eager", max_num_seqs=4, page_size=8, max_seq_len=MAX_SEQ_LEN))
    prompt = TOK.encode("nucleus")
    want = engine.generate([prompt], SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=9, top_p=0.3))[0]
    got = openai_client(server.url).completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=1.0,
                                                       seed=9, top_p=0.3, extra_body={"return_token_ids": True})
    assert got.choices[0].token_ids == want
