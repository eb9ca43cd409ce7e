"""A request's token events as text pieces, and the streaming endpoints' server-sent events written straight to
the ASGI server.

Why not Starlette's ``StreamingResponse``: per streamed chunk it goes through an async generator per layer and
every middleware's ``send`` wrapper (FastAPI stacks five), and per request it starts a task group with a second
disconnect listener (uvicorn reports ASGI spec 2.3) and builds its headers. At a thousand streams that was most of
the HTTP process's time per token. :class:`SSEResponse` is still returned by a FastAPI route (routing, validation
and the error handlers before the stream starts stay FastAPI's), but it sends on the server's own ``send`` (which
:func:`piecegraph.server.app.create_app`'s app puts in the scope), from one coroutine, with what is ready merged
into one ``send``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _json_str  # json.dumps(str)'s own C escaper
from typing import Any

from starlette.responses import Response

from piecegraph.server.loop import Ticket
from piecegraph.server.protocol import APIError
from piecegraph.server.stream import TextStream

log = logging.getLogger("piecegraph.server")

FINISH = {"eos": "stop", "length": "length", "aborted": "abort"}  # engine reason -> OpenAI's
RAW_SEND = "piecegraph.send"  # scope key: the ASGI server's own send, under every middleware wrapper
RAW_RECEIVE = "piecegraph.receive"
# What StreamingResponse(media_type="text/event-stream", headers=...) sent, in its order, built once.
SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
               (b"content-type", b"text/event-stream; charset=utf-8")]
_START = {"type": "http.response.start", "status": 200, "headers": SSE_HEADERS}


@dataclass(slots=True)
class Piece:
    text: str
    ids: list[int]
    finish_reason: str | None


class Pieces:
    """Token events of ``ticket`` as text pieces (``await next()``); events queued meanwhile are merged into one
    piece (a slow client gets fewer, larger chunks instead of slowing anything else). The last piece carries the
    finish reason; an engine failure raises :class:`APIError` (500). Records TTFT / ITL / request metrics.
    :meth:`close` (always, in a ``finally``) cancels ``watcher`` and aborts the request if it did not finish."""

    def __init__(self, state: Any, ticket: Ticket, text: TextStream, arrival: float, watcher: asyncio.Future) -> None:
        self.state, self.ticket, self.text, self.arrival, self.watcher = state, ticket, text, arrival, watcher
        self.last, self.finished = arrival, False

    async def next(self) -> Piece:
        queue, metrics = self.ticket.events, self.state.metrics
        event = await queue.get()
        ids, reason, error = event.ids, event.finish_reason, event.error
        while not queue.empty():  # fell behind: merge what queued meanwhile (one chunk, every token counted)
            event = queue.get_nowait()
            ids = ids + event.ids
            reason, error = reason or event.finish_reason, error or event.error
        if error and reason != "aborted":
            raise APIError(500, error, type="server_error")
        now = time.perf_counter()
        if ids:
            if self.last == self.arrival:
                metrics.observe("piecegraph_time_to_first_token_seconds", now - self.arrival)
                if len(ids) > 1:
                    metrics.observe("piecegraph_inter_token_latency_seconds", 0.0, len(ids) - 1)
            else:
                metrics.observe("piecegraph_inter_token_latency_seconds", (now - self.last) / len(ids), len(ids))
            self.last = now
        text = self.text
        delta, kept = text.feed(ids)
        if text.stopped:
            self.state.loop.abort(self.ticket)  # a stop id or string the engine does not know: free its pages now
            reason = "stop"
        elif reason:
            delta += text.finish()
            reason = FINISH.get(reason, reason)
        if reason:
            self.finished = True
            metrics.inc("piecegraph_requests_total", finish_reason=reason)
            metrics.inc("piecegraph_generation_tokens_total", len(text.ids))
            if self.ticket.cached_tokens:
                metrics.inc("piecegraph_prompt_cached_tokens_total", self.ticket.cached_tokens)
            metrics.observe("piecegraph_request_latency_seconds", now - self.arrival)
        return Piece(delta, kept, reason)

    def close(self) -> None:
        self.watcher.cancel()
        if not self.finished:
            self.state.loop.abort(self.ticket)


class ChunkFormat:
    """One request's SSE ``data:`` chunks, byte for byte what ``json.dumps`` of OpenAI's chunk dict gives, built
    from a prefix and suffix made once per request plus the json-escaped text (a dict and ``json.dumps`` per token
    cost several microseconds; at tens of thousands of tokens a second that is the HTTP process's budget)."""

    def __init__(self, head: dict[str, Any], chat: bool, return_ids: bool) -> None:
        self.kind = "chat.completion.chunk" if chat else "text_completion"
        self.head, self.chat, self.return_ids = head, chat, return_ids
        opened = json.dumps({**head, "object": self.kind})[:-1]
        self.prefix = f'data: {opened}, "choices": [{{"index": 0, "logprobs": null, "finish_reason": '

    def chunk(self, text: str | None, ids: list[int], reason: str | None, role: bool = False) -> str:
        parts = [self.prefix, "null" if reason is None else _json_str(reason)]
        if self.chat:
            if role:
                parts.append(', "delta": {"role": "assistant", "content": ' + _json_str(text or "") + "}")
            else:
                parts.append(', "delta": {"content": ' + _json_str(text) + "}" if text else ', "delta": {}')
        else:
            parts.append(', "text": ' + _json_str(text or ""))
        if self.return_ids:
            parts.append(', "token_ids": [' + ", ".join(map(str, ids)) + "]")
        parts.append("}]}\n\n")
        return "".join(parts)

    def usage(self, prompt_len: int, completion: int, cached: int | None = None) -> str:
        usage = usage_of(prompt_len, completion, cached)
        return f"data: {json.dumps({**self.head, 'object': self.kind, 'choices': [], 'usage': usage})}\n\n"


def usage_of(prompt_len: int, completion: int, cached: int | None) -> dict:
    """OpenAI's ``usage``: token counts and, from an engine with a prefix cache (``cached`` not ``None``),
    ``prompt_tokens_details.cached_tokens``, the prompt tokens it held (not computed again)."""
    usage: dict = {"prompt_tokens": prompt_len, "completion_tokens": completion,
                   "total_tokens": prompt_len + completion}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


class SSEResponse(Response):
    """The event stream of one request: chat opens with the assistant role, one ``data:`` chunk per piece with
    text, a finish or ids, a usage chunk when asked, then ``data: [DONE]``; an engine failure mid-stream is sent
    as an error event. Everything ready is one ``send``: the role chunk goes with the first piece; the last piece,
    the usage and ``[DONE]`` end the body together. Sends on the scope's :data:`RAW_SEND` when there is one.

    Constraint: once the response has started nothing may raise to the middleware (it does not know the response
    started, so it would try a 500 on top of it): failures after that point are logged and end the stream."""

    background = None  # FastAPI sets background tasks on a returned Response; this one runs none
    media_type = "text/event-stream"

    def __init__(self, pieces: Pieces, fmt: ChunkFormat, prompt_len: int, include_usage: bool) -> None:
        # No Response.__init__: its header building per request is what SSE_HEADERS replaces.
        self.pieces, self.fmt, self.prompt_len, self.include_usage = pieces, fmt, prompt_len, include_usage
        self.status_code, self.raw_headers = 200, SSE_HEADERS

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        send = scope.get(RAW_SEND, send)
        pieces, fmt, return_ids = self.pieces, self.fmt, self.fmt.return_ids
        out = [fmt.chunk(None, [], None, role=True)] if fmt.chat else []
        completion = 0
        try:
            await send(_START)
            while True:
                try:
                    piece = await pieces.next()
                except APIError as err:
                    out.append(f"data: {json.dumps(err.body())}\n\n")
                    break
                completion += len(piece.ids)
                if piece.text or piece.finish_reason or (return_ids and piece.ids):
                    out.append(fmt.chunk(piece.text, piece.ids, piece.finish_reason))
                if piece.finish_reason:
                    break
                if out:
                    await send({"type": "http.response.body", "body": "".join(out).encode(), "more_body": True})
                    out.clear()
            if self.include_usage:
                out.append(fmt.usage(self.prompt_len, completion, pieces.ticket.cached_tokens))
            out.append("data: [DONE]\n\n")
            await send({"type": "http.response.body", "body": "".join(out).encode(), "more_body": False})
        except Exception:  # noqa: BLE001  (see the constraint above)
            log.exception("%s: the event stream failed", pieces.ticket.id)
        finally:
            pieces.close()
