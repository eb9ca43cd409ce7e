"""The raw SSE path without a model: its bytes equal what ``json.dumps`` of OpenAI's chunks through Starlette's
``StreamingResponse`` sent (headers included), merged deltas keep every token, an engine failure mid-stream is an
error event, a client that leaves aborts its request, and the engine process's command pipe never blocks the
server's loop (a blocking write once deadlocked it at a few hundred concurrent requests)."""

import asyncio
import json
import time

import pytest

pytest.importorskip("fastapi")

from piecegraph.serve import SamplingParams  # noqa: E402
from piecegraph.server.app import ServerState  # noqa: E402
from piecegraph.server.loop import Event, Ticket  # noqa: E402
from piecegraph.server.metrics import Metrics  # noqa: E402
from piecegraph.server.sse import RAW_SEND, SSE_HEADERS, ChunkFormat, Pieces, SSEResponse  # noqa: E402
from piecegraph.server.stream import TextStream  # noqa: E402
from piecegraph.server.tokenizer import ByteTokenizer  # noqa: E402

TOK = ByteTokenizer()
HEAD = {"id": "cmpl-7", "created": 1, "model": "tiny"}


class NoLoop:
    def __init__(self):
        self.aborted = []

    def abort(self, ticket):
        self.aborted.append(ticket.id)


def _reference(chat, return_ids, steps, reason, usage):
    """What the old path sent: one json.dumps'd chunk per step (chat opens with the role), usage, [DONE]."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    out = []

    def chunk(choice):
        out.append(f"data: {json.dumps({**HEAD, 'object': kind, 'choices': [choice]})}\n\n")

    if chat:
        role = {"index": 0, "logprobs": None, "finish_reason": None, "delta": {"role": "assistant", "content": ""}}
        chunk({**role, "token_ids": []} if return_ids else role)
    for n, ids in enumerate(steps + [[]]):  # the finish comes as an event of its own: a last, empty chunk
        text = TOK.decode(ids)
        choice = {"index": 0, "logprobs": None, "finish_reason": reason if n == len(steps) else None}
        if chat:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text
        if return_ids:
            choice["token_ids"] = ids
        chunk(choice)
    if usage:
        completion = sum(map(len, steps))
        out.append(f"data: {json.dumps({**HEAD, 'object': kind, 'choices': [], 'usage': {'prompt_tokens': 2, 'completion_tokens': completion, 'total_tokens': 2 + completion}})}\n\n")  # noqa: E501
    out.append("data: [DONE]\n\n")
    return "".join(out)


async def _stream(steps, *, chat, return_ids, usage, finish="length", error=None, pace=True):
    """Run an SSEResponse over ``steps`` (lists of ids, one event each); returns (state, ASGI messages sent).
    ``pace``: hand the handler one event at a time (one chunk each); else queue them all first (merged)."""
    state = ServerState(loop=NoLoop(), tokenizer=TOK, model_name="tiny", max_seq_len=128, vocab_size=256,
                        metrics=Metrics())
    ticket = Ticket(HEAD["id"], [1, 2], SamplingParams(), asyncio.Queue(), asyncio.get_running_loop())
    events = [Event(ids) for ids in steps] + [Event([], finish_reason=finish, error=error)]
    if not pace:
        for event in events:
            ticket.events.put_nowait(event)
    watcher = asyncio.ensure_future(asyncio.sleep(30))
    pieces = Pieces(state, ticket, TextStream(TOK), time.perf_counter(), watcher)
    response = SSEResponse(pieces, ChunkFormat(HEAD, chat, return_ids), 2, usage)
    sent = []

    async def send(message):
        sent.append(message)
        if pace and events:
            ticket.events.put_nowait(events.pop(0))

    async def wrapped(message):  # a middleware wrapper: the raw path must not use it
        raise AssertionError("sent through the middleware")

    await response({"type": "http", RAW_SEND: send}, None, wrapped)
    await asyncio.sleep(0)  # let the cancellation land
    assert watcher.cancelled()
    return state, sent


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("return_ids", [False, True])
@pytest.mark.parametrize("usage", [False, True])
def test_raw_stream_bytes_equal_the_old_streaming_response(chat, return_ids, usage):
    steps = [list(b"he"), list(b"llo"), list(' "w\\'.encode()), list(b"!")]
    _, sent = asyncio.run(_stream(steps, chat=chat, return_ids=return_ids, usage=usage))
    assert sent[0] == {"type": "http.response.start", "status": 200, "headers": SSE_HEADERS}
    assert [m["more_body"] for m in sent[1:]] == [True] * (len(sent) - 2) + [False]
    body = b"".join(m["body"] for m in sent[1:]).decode()
    assert body == _reference(chat, return_ids, steps, "length", usage)
    assert len(sent) == 1 + len(steps) + 1  # start, a send per step, the finish with usage and [DONE] in one


def test_raw_stream_headers_equal_streaming_response():
    from starlette.responses import StreamingResponse

    async def nothing():
        yield ""

    old = StreamingResponse(nothing(), media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    assert old.raw_headers == SSE_HEADERS


def test_coalesced_deltas_keep_the_exact_text_token_ids_and_usage():
    """A handler that fell behind finds several steps' events queued and sends them as one chunk: the text, the
    ids (and so the client's count) and the usage still cover every token."""
    from piecegraph.serve.http_bench import _count_ids

    text = 'héllo "数" world 😀!'
    ids = list(text.encode())
    steps = [ids[i:i + 3] for i in range(0, len(ids), 3)]
    state, sent = asyncio.run(_stream(steps, chat=False, return_ids=True, usage=True, pace=False))
    assert len(sent) == 2 and not sent[1]["more_body"]  # start, then everything in one send
    events = sent[1]["body"].decode().split("\n\n")
    assert events[2] == "data: [DONE]" and len(events) == 4  # the merged chunk, usage, [DONE], ""
    chunk, usage = (json.loads(e[6:]) for e in events[:2])
    assert chunk["choices"][0]["text"] == text and chunk["choices"][0]["token_ids"] == ids
    assert chunk["choices"][0]["finish_reason"] == "length"
    assert usage["usage"] == {"prompt_tokens": 2, "completion_tokens": len(ids), "total_tokens": 2 + len(ids)}
    assert _count_ids(events[0].encode()) == len(ids)
    assert state.metrics.value("piecegraph_generation_tokens_total") == len(ids)


def test_engine_failure_mid_stream_is_an_error_event_then_done():
    state, sent = asyncio.run(_stream([[104]], chat=True, return_ids=False, usage=False, finish=None,
                                      error="the engine failed: boom"))
    body = b"".join(m["body"] for m in sent[1:]).decode()
    *chunks, error, done, _ = body.split("\n\n")
    assert json.loads(error[6:])["error"]["message"] == "the engine failed: boom" and done == "data: [DONE]"
    assert state.loop.aborted == [HEAD["id"]]  # not finished: aborted, its pages freed


def test_client_that_leaves_mid_stream_aborts_on_the_raw_path():
    """Over HTTP with the process-free loop: the raw path's single disconnect watcher aborts the request."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from piecegraph.server.run import BackgroundServer

    class Loop(NoLoop):
        alive, max_pending = True, 8

        def submit(self, prompt, params, *, prefix):
            ticket = Ticket(f"{prefix}-1", prompt, params, asyncio.Queue(), asyncio.get_running_loop())
            ticket.events.put_nowait(Event([]))  # accepted
            ticket.events.put_nowait(Event([104]))  # one token, then nothing until the client leaves
            return ticket

        def begin_close(self):
            pass

        def close(self, drain_s):
            pass

    state = ServerState(loop=Loop(), tokenizer=TOK, model_name="tiny", max_seq_len=128, vocab_size=256,
                        metrics=Metrics(), drain_s=1)
    with BackgroundServer(state) as server:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 50, "stream": True}
        with httpx.Client(base_url=server.url, timeout=10) as client:
            with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
                assert r.headers["cache-control"] == "no-cache" and r.headers["transfer-encoding"] == "chunked"
                assert next(r.iter_lines()).startswith("data: {")
        deadline = time.monotonic() + 5
        while not state.loop.aborted and time.monotonic() < deadline:
            time.sleep(0.01)
    assert state.loop.aborted == ["cmpl-1"]


def test_command_pipe_never_blocks_the_loop_and_keeps_order():
    """Far more than a pipe holds, sent from the loop while nobody reads: no send blocks; once the reader
    drains, every message arrives whole and in order."""
    import multiprocessing

    from piecegraph.server.remote import _CommandWriter

    recv, send = multiprocessing.Pipe(duplex=False)
    messages = [("add", f"cmpl-{i}", list(range(i % 300)), SamplingParams(max_new_tokens=1 + i % 7))
                for i in range(3000)]

    async def main():
        writer, loop = _CommandWriter(send), asyncio.get_running_loop()
        start = time.monotonic()
        for message in messages:
            writer.send(message, loop)
        assert time.monotonic() - start < 5 and writer.buf  # it buffered instead of blocking
        # Read on a thread, as the child does: a message may arrive in parts, the rest written when the loop's
        # writer callback finds the pipe writable again.
        got = await asyncio.to_thread(lambda: [recv.recv() for _ in messages])
        await asyncio.sleep(0)
        assert not writer.buf and writer.armed is None
        return got

    assert asyncio.run(main()) == messages
    send.close()
    recv.close()
