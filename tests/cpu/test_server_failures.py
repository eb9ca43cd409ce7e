"""The server when things go wrong, on a small server (two requests at once, slow steps, a tokenizer without a
chat template) and on one whose engine runs in its own process: a full queue gets 429 with Retry-After; chat
without a template is a clear 400; a client that goes away, streaming or waiting, frees its pages; an engine
failure fails the requests in flight, not the loop; the engine process serves the in-process engine's tokens,
frees its pages, and its death turns into 503s instead of a hang."""

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import serve_helpers
from server_helpers import MAX_SEQ_LEN, NEW, TOK, all_pages_free, completion, httpx, text_prompts, wait_all_pages_free

from piecegraph.models import TINY, Decoder
from piecegraph.serve import Engine, EngineConfig, SamplingParams
from piecegraph.server.run import BackgroundServer, build_state
from piecegraph.server.tokenizer import ByteTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


model = serve_helpers.model  # the module-scoped TINY decoder (seed 3) the serving tests share


class SlowEngine(Engine):
    """Steps take at least 4 ms (so a client can leave mid-generation), and one step can be told to fail."""

    fail_next = False

    def step(self):
        time.sleep(0.004)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected engine failure")
        return super().step()


@pytest.fixture(scope="module")
def small(model):
    """A server that admits two requests at once, with a slow engine and a tokenizer without a chat template."""
    config = EngineConfig(mode="eager", max_num_seqs=2, max_num_batched_tokens=64, page_size=8, max_seq_len=256)
    state = build_state(SlowEngine(model, config), ByteTokenizer(chat_template=False), "tiny", max_pending=2,
                        drain_s=2)
    with BackgroundServer(state) as running:
        yield running


def test_full_queue_gets_429_with_retry_after(small):
    body = {"model": "tiny", "prompt": "hold", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.Client(base_url=small.url, timeout=30) as a, httpx.Client(base_url=small.url, timeout=30) as b:
        with a.stream("POST", "/v1/completions", json=body) as s1, b.stream("POST", "/v1/completions", json=body) as s2:
            assert s1.status_code == s2.status_code == 200
            r = httpx.post(small.url + "/v1/completions", json=body)
            assert r.status_code == 429 and r.headers["Retry-After"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
    assert wait_all_pages_free(small.state.loop.engine)


def test_chat_without_template_is_a_clear_400(small):
    r = httpx.post(small.url + "/v1/chat/completions",
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "chat template" in r.json()["error"]["message"]


def test_client_disconnect_mid_stream_frees_pages(small):
    engine = small.state.loop.engine
    aborted = engine.stats()["aborted"]
    body = {"model": "tiny", "prompt": "leave early", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.Client(base_url=small.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            while not next(lines).startswith("data:"):
                pass
            assert not all_pages_free(engine)  # it is generating, holding pages
    assert wait_all_pages_free(engine)
    assert engine.stats()["aborted"] == aborted + 1


def test_client_disconnect_while_waiting_non_streaming_frees_pages(small):
    engine = small.state.loop.engine
    aborted = engine.stats()["aborted"]
    body = json.dumps({"model": "tiny", "prompt": "gone", "max_tokens": 200}).encode()
    with socket.create_connection(("127.0.0.1", small.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 5
        while all_pages_free(engine) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not all_pages_free(engine)
    assert wait_all_pages_free(engine)
    assert engine.stats()["aborted"] == aborted + 1


def test_engine_failure_fails_requests_in_flight_not_the_loop(small):
    engine = small.state.loop.engine
    engine.fail_next = True
    r = httpx.post(small.url + "/v1/completions", json={"model": "tiny", "prompt": "boom", "max_tokens": 5})
    assert r.status_code == 500 and "injected engine failure" in r.json()["error"]["message"]
    assert wait_all_pages_free(engine)
    r = httpx.post(small.url + "/v1/completions", json={"model": "tiny", "prompt": "after", "max_tokens": 5})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_engine_in_its_own_process_serves_the_same_tokens_and_frees_pages():
    """``serve --engine-process`` (the default): the engine built by the CLI's factory in a spawned child."""
    import functools

    import torch

    from piecegraph.server.command import build_engine
    from piecegraph.server.run import build_process_state

    config = EngineConfig(mode="eager", max_num_seqs=8, max_num_batched_tokens=64, page_size=8, max_seq_len=256)
    factory = functools.partial(build_engine, "tiny", "cpu", torch.float32, False, config)
    state = build_process_state(factory, ByteTokenizer, "tiny", max_pending=16, drain_s=5)
    prompts = text_prompts(12, seed=5)
    preset = Engine(Decoder.random(TINY, seed=0).eval(), EngineConfig(mode="eager", max_num_seqs=16, page_size=8,
                                                                      max_seq_len=MAX_SEQ_LEN))
    want = preset.generate([TOK.encode(p) for p in prompts], SamplingParams(max_new_tokens=NEW))
    with BackgroundServer(state) as server:
        with ThreadPoolExecutor(12) as pool:
            got = list(pool.map(lambda i: completion(server.url, prompts[i], i % 2 == 0), range(12)))
        assert [ids for _, ids, _ in got] == want
        body = {"model": "tiny", "prompt": "leave", "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.Client(base_url=server.url, timeout=30) as client:
            with client.stream("POST", "/v1/completions", json=body) as stream:
                next(line for line in stream.iter_lines() if line.startswith("data:"))
        deadline = time.monotonic() + 10
        while state.loop.load()["piecegraph_kv_pages_used"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert state.loop.load()["piecegraph_kv_pages_used"] == 0
        assert "piecegraph_kv_pages_used 0" in httpx.get(server.url + "/metrics").text
        state.loop._proc.kill()  # the engine process dies: the server says so instead of hanging
        deadline = time.monotonic() + 10
        while state.loop.alive and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.get(server.url + "/health").status_code == 503
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
    assert not state.loop.alive
