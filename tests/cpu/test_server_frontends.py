"""Several HTTP front-end processes on one engine process (``piecegraph serve --api-servers N``): the same tokens
as the engine alone, events routed to the front end that sent each request, metrics summed over front ends, and a
front end that dies takes only its own requests (their pages freed)."""

import contextlib
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import Pipe

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from piecegraph.models import TINY, Decoder  # noqa: E402
from piecegraph.serve import Engine, EngineConfig, SamplingParams  # noqa: E402
from piecegraph.server.engine_child import CounterBatch, EventRouter, PipeInbox  # noqa: E402
from piecegraph.server.metrics import Metrics  # noqa: E402
from piecegraph.server.tokenizer import ByteTokenizer  # noqa: E402

TOK = ByteTokenizer()
NEW = 10
SERIES = st.sampled_from([("piecegraph_requests_total", {"finish_reason": "length"}),
                          ("piecegraph_requests_total", {"finish_reason": "stop"}),
                          ("piecegraph_generation_tokens_total", {}),
                          ("piecegraph_engine_steps_total", {"kind": "full"})])

EXACT = st.integers(0, 320).map(lambda x: x / 8)  # binary fractions: sums do not depend on the order of addition


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.booleans(), SERIES, EXACT, st.integers(1, 5)),
                max_size=40))
def test_metrics_of_front_ends_add_up_to_one_server_seeing_everything(writes):
    """Property: whatever is split over three front ends, /metrics of any one (its own + the others' snapshots)
    equals what one Metrics that saw every write renders."""
    parts = [Metrics(gauges=lambda k=k: {"piecegraph_requests_running": k + 1, "piecegraph_kv_pages_used": 7})
             for k in range(3)]
    whole = Metrics(gauges=lambda: {"piecegraph_requests_running": 6, "piecegraph_kv_pages_used": 7})
    for k, hist, (name, labels), value, times in writes:
        for m in (parts[k], whole):
            if hist:
                m.observe("piecegraph_time_to_first_token_seconds", value, times)
            else:
                m.inc(name, times, **labels)
    for k in range(3):
        parts[k].peers = lambda k=k: [parts[j].snapshot() for j in range(3) if j != k]
        assert parts[k].render() == whole.render()  # front-end gauges summed, the engine's KV pages not


class _FakeLoop:
    """What PipeInbox drives: records enqueued tickets and aborts."""

    def __init__(self):
        self.added, self.aborted, self.closing, self.stopped = [], [], False, False

    def enqueue(self, ticket):
        self.added.append(ticket.id)

    def abort_id(self, rid):
        self.aborted.append(rid)

    def begin_close(self):
        self.closing = True


def test_events_go_to_the_front_end_that_sent_the_request_and_a_lost_one_is_aborted():
    cmds = [Pipe(duplex=False) for _ in range(2)]  # (recv, send)
    evs = [Pipe(duplex=False) for _ in range(2)]
    inbox = PipeInbox([r for r, _ in cmds])
    inbox.loop = loop = _FakeLoop()

    class _Cache:
        num_pages, num_free_pages = 9, 5

    counters = CounterBatch()
    counters.inc("piecegraph_engine_steps_total", 2, kind="full")
    router = EventRouter([s for _, s in evs], inbox.owner, _Cache(), counters)
    params = SamplingParams(max_new_tokens=3)
    cmds[0][1].send(("add", "a", [1], params))
    cmds[1][1].send(("add", "b", [2], params))
    cmds[1][1].send(("add", "c", [3], params))
    while len(loop.added) < 3:
        inbox.get(1.0)
    assert sorted(loop.added) == ["a", "b", "c"] and inbox.owner == {"a": 0, "b": 1, "c": 1}
    router.send([("a", [5], None, None, False), ("b", [6], "length", None, False), ("c", [7], None, None, False)])
    got0, got1 = evs[0][0].recv(), evs[1][0].recv()
    assert [r[0] for r in got0[1]] == ["a"] and [r[0] for r in got1[1]] == ["b", "c"]
    full = [("piecegraph_engine_steps_total", (("kind", "full"),), 2.0)]
    assert got0[2] == {"used": 3, "total": 8} and got0[3] == full and got1[3] == []
    assert "b" not in inbox.owner  # finished: its route is gone
    assert not loop.closing
    cmds[0][1].send(("close", 5.0))  # one front end asking alone does not stop the engine for the other
    inbox.get(1.0)
    assert not loop.closing
    cmds[1][1].close()  # front end 1 dies: its live request is aborted, and front end 0's close now holds
    inbox.get(1.0)
    assert loop.aborted == ["c"] and loop.closing and inbox.deadline is not None


class _Req:
    def __init__(self, rid, reason=None):
        self.id, self.finish_reason = rid, reason


def test_a_step_goes_to_every_front_end_as_one_message_and_its_counters_are_counted_once():
    """Each front end gets the whole step and keeps its own rows (ids are unique across front ends); the counters
    ride with it, marked for the lowest live front end; a finished id's route is gone; a dead front end is
    skipped and the next one counts."""
    evs = [Pipe(duplex=False) for _ in range(3)]

    class _Cache:
        num_pages, num_free_pages = 9, 5

    counters = CounterBatch()
    counters.inc("piecegraph_engine_steps_total", 1, kind="full")
    owner = {"a": 0, "b": 1, "c": 2}
    router = EventRouter([s for _, s in evs], owner, _Cache(), counters)
    router.step([_Req("a"), _Req("b", "length"), _Req("c")], [5, 6, 7], [_Req("b", "length")])
    full = [("piecegraph_engine_steps_total", (("kind", "full"),), 1.0)]
    for k, (recv, _) in enumerate(evs):
        assert recv.recv() == ("tokens", ["a", "b", "c"], [5, 6, 7], {"b": "length"}, {"used": 3, "total": 8},
                               full, 0), k
    assert owner == {"a": 0, "c": 2}
    evs[0][0].close()  # front end 0 dies: its sends fail, front end 1 counts from now on
    counters.inc("piecegraph_engine_steps_total", 2, kind="full")
    router.step([_Req("c")], [8], [])
    router.step([_Req("c")], [9], [])
    second = [evs[1][0].recv(), evs[1][0].recv()]
    assert [m[1:3] for m in second] == [(["c"], [8]), (["c"], [9])]
    assert [m[6] for m in second] == [0, 1]  # the step that found front end 0 dead was marked for it ...
    assert second[1][5] == [("piecegraph_engine_steps_total", (("kind", "full"),), 2.0)]  # ... so the next carries


class _SlowEngine(Engine):
    """Steps take at least 5 ms, so requests are still generating when a test looks."""

    def step(self):
        time.sleep(0.005)
        return super().step()


def slow_tiny_engine():
    """The engine process's factory (spawned: it imports this module by name and calls this)."""
    config = EngineConfig(mode="eager", max_num_seqs=8, max_num_batched_tokens=64, page_size=8, max_seq_len=256)
    return _SlowEngine(Decoder.random(TINY, seed=0).eval(), config)


def page_per_token_engine():
    """A factory whose KV pages hold one token each: the pages in use change at every step."""
    config = EngineConfig(mode="eager", max_num_seqs=8, max_num_batched_tokens=64, page_size=1, max_seq_len=256)
    return Engine(Decoder.random(TINY, seed=0).eval(), config)


def _serve(factory):
    import torch

    from piecegraph.server.run import BackgroundServer, build_process_state

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine process takes this count (two shared cores: no OpenMP spinning)
    try:
        state = build_process_state(factory, ByteTokenizer, "tiny", max_pending=64, drain_s=5, frontends=2)
    finally:
        torch.set_num_threads(threads)
    return BackgroundServer(state)


def test_a_front_end_without_requests_keeps_reading_so_the_engine_never_blocks():
    """The engine process tells every front end when KV pages change; one that had no request yet must read
    them too (it binds its reader when the app starts), or its pipe fills (~64 KiB, ~700 messages) and the
    engine blocks sending to it. One keep-alive connection: every request reaches the same front end."""
    with _serve(page_per_token_engine) as server:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for i in range(6):  # ~1200 page changes in all
                body = {"model": "tiny", "prompt": f"one connection {i}", "max_tokens": 200, "temperature": 0}
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 200


@pytest.fixture(scope="module")
def two_front_ends():
    with _serve(slow_tiny_engine) as server:
        yield server


def _completion(url, i, prompt):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": NEW, "temperature": 0, "return_token_ids": True,
            "stream": i % 2 == 0}
    with httpx.Client(base_url=url, timeout=60) as client:  # a new connection each: the kernel spreads them
        if not body["stream"]:
            return client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
        ids = []
        with client.stream("POST", "/v1/completions", json=body) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: {"):
                    ids += json.loads(line[6:])["choices"][0]["token_ids"]
        return ids


def _metric(url, name):
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_two_front_ends_serve_the_engines_tokens_and_share_the_load(two_front_ends):
    server = two_front_ends
    prompts = [f"front end {i} " * (1 + i % 3) for i in range(32)]
    preset = Engine(Decoder.random(TINY, seed=0).eval(), EngineConfig(mode="eager", max_num_seqs=32, page_size=8,
                                                                      max_seq_len=256))
    want = preset.generate([TOK.encode(p) for p in prompts], SamplingParams(max_new_tokens=NEW))
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda i: _completion(server.url, i, prompts[i]), range(32)))
    assert got == want
    time.sleep(2.5)  # the other front end's metrics snapshot is written every second
    assert _metric(server.url, 'piecegraph_requests_total{finish_reason="length"}') == 32
    own = server.state.metrics.value("piecegraph_requests_total", finish_reason="length")
    assert 0 < own < 32, own  # both processes served (all 32 on one: odds 2^-31)
    assert _metric(server.url, "piecegraph_generation_tokens_total") == 32 * NEW
    assert _metric(server.url, "piecegraph_kv_pages_used") == 0
    # the engine process's loop and step-phase seconds reach /metrics through the front ends' pipes
    assert _metric(server.url, 'piecegraph_engine_loop_seconds_total{part="step"}') > 0
    assert _metric(server.url, 'piecegraph_engine_step_phase_seconds_total{phase="forward_launch"}') > 0


def test_a_front_end_that_dies_takes_only_its_requests(two_front_ends):
    server = two_front_ends
    body = {"model": "tiny", "prompt": "long", "max_tokens": 200, "temperature": 0, "stream": True}
    finished = 0
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(httpx.Client(base_url=server.url, timeout=30)) for _ in range(24)]
        streams = [stack.enter_context(c.stream("POST", "/v1/completions", json=body)) for c in clients]
        assert [s.status_code for s in streams] == [200] * 24
        assert _metric(server.url, "piecegraph_kv_pages_used") > 0
        peer = server.frontends.processes[0]
        os.kill(peer.pid, signal.SIGKILL)
        peer.join(10)
        for s in streams:
            try:
                finished += any(line.endswith("[DONE]") for line in s.iter_lines())
            except httpx.HTTPError:
                pass
    assert 0 < finished < 24, finished  # front end 0's streams complete, the dead one's do not (odds all on one: 2^-23)
    deadline = time.monotonic() + 10
    while server.state.loop.load()["piecegraph_kv_pages_used"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.state.loop.load()["piecegraph_kv_pages_used"] == 0  # the dead front end's requests were freed
    assert _completion(server.url, 1, "still here")  # front end 0 serves on
