"""The HTTP routes: OpenAI's completions and chat (streaming as server-sent events), models, health, metrics.

FastAPI on uvicorn: the most used ASGI pair in Python serving (vLLM and SGLang both use it), maintained, and the
official ``openai`` client is tested against servers built on it. Handlers parse and validate (see
:mod:`piecegraph.server.protocol`), tokenize, submit to the :class:`~piecegraph.server.loop.EngineLoop`, and turn
its token events into text with :class:`~piecegraph.server.stream.TextStream`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _json_str  # json.dumps(str)'s own C escaper
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from piecegraph.server.loop import Closed, EngineLoop, Event, QueueFull, Ticket
from piecegraph.server.metrics import Metrics
from piecegraph.server.protocol import APIError, ChatRequest, CompletionRequest, parse
from piecegraph.server.sampling import build_params
from piecegraph.server.stream import TextStream
from piecegraph.server.tokenizer import NoChatTemplate, Tokenizer

log = logging.getLogger("piecegraph.server")

FINISH = {"eos": "stop", "length": "length", "aborted": "abort"}  # engine reason -> OpenAI's


@dataclass
class ServerState:
    """What the routes share: the engine loop, the tokenizer, the served model's name and limits, metrics.
    ``drain_s``: at shutdown, how long in-flight requests may run before they are aborted."""

    loop: EngineLoop
    tokenizer: Tokenizer
    model_name: str
    max_seq_len: int
    vocab_size: int
    metrics: Metrics
    drain_s: float = 30.0
    created: int = 0


@dataclass
class Piece:
    text: str
    ids: list[int]
    finish_reason: str | None


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI app over ``state``; its lifespan starts the engine loop and closes it (draining) at shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not state.loop.alive:
            state.loop.start()
        yield
        await asyncio.to_thread(state.loop.close, state.drain_s)

    app = FastAPI(title="piecegraph", lifespan=lifespan)
    state.created = state.created or int(time.time())

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        state.metrics.inc("piecegraph_request_errors_total", status=str(err.status))
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return await api_error(request, APIError(err.status_code, str(err.detail), type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        log.exception("unexpected error serving %s", request.url.path)
        return await api_error(request, APIError(500, f"internal error: {type(err).__name__}: {err}",
                                                 type="server_error"))

    @app.get("/health")
    async def health() -> Response:
        if not state.loop.alive:
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "piecegraph", "max_model_len": state.max_seq_len,
                                            "vocab_size": state.vocab_size}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req = parse(await request.body(), CompletionRequest)
        _check_model(state, req.model)
        prompt = _completion_prompt(state, req.prompt)
        return await _generate(state, request, req, prompt, arrival, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        arrival = time.perf_counter()
        req = parse(await request.body(), ChatRequest)
        _check_model(state, req.model)
        try:
            prompt = state.tokenizer.chat([(m.role, m.text()) for m in req.messages])
        except NoChatTemplate as err:
            raise APIError(400, f"messages: {err}", param="messages", code="no_chat_template") from None
        return await _generate(state, request, req, prompt, arrival, chat=True)

    return app


def _check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise APIError(400, f"model: unknown model {model!r}; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")


def _completion_prompt(state: ServerState, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"prompt: batches of prompts are not supported (got {len(prompt)}); send one "
                           "request per prompt", param="prompt")
        prompt = prompt[0]
    ids = state.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise APIError(400, "prompt: the prompt is empty", param="prompt")
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(400, f"prompt: token ids {bad[:5]} are outside the vocabulary [0, {state.vocab_size})",
                       param="prompt")
    return ids


async def _generate(state: ServerState, request: Request, req: Any, prompt: list[int], arrival: float, *,
                    chat: bool) -> Response:
    params, stop, stop_ids = build_params(req, prompt, state.tokenizer, state.max_seq_len, state.vocab_size,
                                          chat=chat)
    try:
        ticket = state.loop.submit(prompt, params, prefix="chatcmpl" if chat else "cmpl")
    except QueueFull as err:
        raise APIError(429, f"the server is at capacity: {err}; retry shortly", type="rate_limit_error",
                       code="queue_full", headers={"Retry-After": "1"}) from None
    except Closed as err:
        raise APIError(503, str(err), type="server_error", headers={"Retry-After": "5"}) from None
    watcher = asyncio.ensure_future(_watch_disconnect(state, request, ticket))
    try:
        ack = await ticket.events.get()
    except BaseException:
        watcher.cancel()
        state.loop.abort(ticket)
        raise
    if ack.finish_reason == "aborted":  # the client left before the engine took the request
        watcher.cancel()
        raise APIError(499, "the client closed the request", code="client_closed")
    if ack.error:
        watcher.cancel()
        raise APIError(400 if ack.refused else 500, f"prompt: {ack.error}" if ack.refused else ack.error,
                       param="prompt" if ack.refused else None, type="invalid_request_error" if ack.refused
                       else "server_error")
    state.metrics.inc("piecegraph_prompt_tokens_total", len(prompt))
    text = TextStream(state.tokenizer, stop, stop_ids)
    pieces = _pieces(state, ticket, text, arrival, watcher)
    head = {"id": ticket.id, "created": int(time.time()), "model": state.model_name}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = _sse(pieces, head, chat, req.return_token_ids, len(prompt), include_usage)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return JSONResponse(await _collect(pieces, head, chat, req.return_token_ids, prompt))


async def _watch_disconnect(state: ServerState, request: Request, ticket: Ticket) -> None:
    """A client that goes away aborts its request (the engine frees its pages at its next iteration)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            if not ticket.done:
                log.info("%s: the client disconnected; aborted", ticket.id)
            state.loop.abort(ticket)
            ticket.events.put_nowait(Event([], finish_reason="aborted", error="client disconnected"))
            return


async def _pieces(state: ServerState, ticket: Ticket, text: TextStream, arrival: float,
                  watcher: asyncio.Future) -> AsyncIterator[Piece]:
    """Token events as text pieces; events queued meanwhile are merged into one piece (a slow client gets fewer,
    larger chunks instead of slowing anything else). Ends with a piece carrying the finish reason."""
    metrics, last, finished, queue = state.metrics, arrival, False, ticket.events
    try:
        while True:
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
                name = "piecegraph_time_to_first_token_seconds" if last == arrival else None
                if name:
                    metrics.observe(name, now - arrival)
                    if len(ids) > 1:
                        metrics.observe("piecegraph_inter_token_latency_seconds", 0.0, len(ids) - 1)
                else:
                    metrics.observe("piecegraph_inter_token_latency_seconds", (now - last) / len(ids), len(ids))
                last = now
            delta, kept = text.feed(ids)
            if text.stopped:
                state.loop.abort(ticket)  # a stop id or string the engine does not know: free its pages now
                reason = "stop"
            elif reason:
                delta += text.finish()
                reason = FINISH.get(reason, reason)
            if reason:
                finished = True
                metrics.inc("piecegraph_requests_total", finish_reason=reason)
                metrics.inc("piecegraph_generation_tokens_total", len(text.ids))
                metrics.observe("piecegraph_request_latency_seconds", now - arrival)
            yield Piece(delta, kept, reason)
            if reason:
                return
    finally:
        watcher.cancel()
        if not finished:
            state.loop.abort(ticket)


async def _collect(pieces: AsyncIterator[Piece], head: dict[str, Any], chat: bool, return_ids: bool,
                   prompt: list[int]) -> dict[str, Any]:
    texts, ids, reason = [], [], None
    async for piece in pieces:
        texts.append(piece.text)
        ids += piece.ids
        reason = piece.finish_reason
    text = "".join(texts)
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if return_ids:
        choice["token_ids"] = ids
        choice["prompt_token_ids"] = prompt
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
    kind = "chat.completion" if chat else "text_completion"
    return {**head, "object": kind, "choices": [choice], "usage": usage}


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

    def usage(self, prompt_len: int, completion: int) -> str:
        usage = {"prompt_tokens": prompt_len, "completion_tokens": completion, "total_tokens": prompt_len + completion}
        return f"data: {json.dumps({**self.head, 'object': self.kind, 'choices': [], 'usage': usage})}\n\n"


async def _sse(pieces: AsyncIterator[Piece], head: dict[str, Any], chat: bool, return_ids: bool, prompt_len: int,
               include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one ``data:`` chunk per piece (chat opens with the assistant role), a usage chunk when
    asked, then ``data: [DONE]``. An engine failure mid-stream is sent as an error event."""
    fmt, completion = ChunkFormat(head, chat, return_ids), 0
    if chat:
        yield fmt.chunk(None, [], None, role=True)
    try:
        async for piece in pieces:
            completion += len(piece.ids)
            if piece.text or piece.finish_reason or (return_ids and piece.ids):
                yield fmt.chunk(piece.text, piece.ids, piece.finish_reason)
    except APIError as err:
        yield f"data: {json.dumps(err.body())}\n\n"
    if include_usage:
        yield fmt.usage(prompt_len, completion)
    yield "data: [DONE]\n\n"
