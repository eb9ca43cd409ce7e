"""The HTTP routes: OpenAI's completions and chat (streaming as server-sent events), models, health, metrics.

FastAPI on uvicorn: the most used ASGI pair in Python serving (vLLM and SGLang both use it), maintained, and the
official ``openai`` client is tested against servers built on it. Handlers parse and validate (see
:mod:`piecegraph.server.protocol`), tokenize, submit to the :class:`~piecegraph.server.loop.EngineLoop`, and turn
its token events into text with :class:`~piecegraph.server.stream.TextStream`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from piecegraph.server.loop import Closed, EngineLoop, Event, QueueFull, Ticket
from piecegraph.server.metrics import Metrics
from piecegraph.server.protocol import APIError, ChatRequest, CompletionRequest, parse
from piecegraph.server.sampling import build_params
from piecegraph.server.sse import RAW_RECEIVE, RAW_SEND, ChunkFormat, Pieces, SSEResponse, usage_of
from piecegraph.server.stream import TextStream
from piecegraph.server.tokenizer import NoChatTemplate, Tokenizer

log = logging.getLogger("piecegraph.server")


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


class _App(FastAPI):
    """FastAPI that also puts the ASGI server's own ``send`` and ``receive`` in the scope, for
    :class:`~piecegraph.server.sse.SSEResponse` to stream on without the middleware wrappers."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        scope[RAW_SEND], scope[RAW_RECEIVE] = send, receive
        await super().__call__(scope, receive, send)


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI app over ``state``; its lifespan starts the engine loop and closes it (draining) at shutdown.
    Streaming responses bypass the middleware's ``send`` wrappers (see :mod:`piecegraph.server.sse`)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not state.loop.alive:
            state.loop.start()
        bind = getattr(state.loop, "bind", None)  # a process engine's event pipe is read on this loop
        if bind is not None:
            bind(asyncio.get_running_loop())
        yield
        await asyncio.to_thread(state.loop.close, state.drain_s)

    app = _App(title="piecegraph", lifespan=lifespan)
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
    pieces = Pieces(state, ticket, TextStream(state.tokenizer, stop, stop_ids), arrival, watcher)
    head = {"id": ticket.id, "created": int(time.time()), "model": state.model_name}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return SSEResponse(pieces, ChunkFormat(head, chat, req.return_token_ids), len(prompt), include_usage)
    return JSONResponse(await _collect(pieces, head, chat, req.return_token_ids, prompt))


async def _watch_disconnect(state: ServerState, request: Request, ticket: Ticket) -> None:
    """A client that goes away aborts its request (the engine frees its pages at its next iteration)."""
    receive = request.scope.get(RAW_RECEIVE, request.receive)  # one listener per request, the server's own
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not ticket.done:
                log.info("%s: the client disconnected; aborted", ticket.id)
            state.loop.abort(ticket)
            ticket.events.put_nowait(Event([], finish_reason="aborted", error="client disconnected"))
            return


async def _collect(pieces: Pieces, head: dict[str, Any], chat: bool, return_ids: bool,
                   prompt: list[int]) -> dict[str, Any]:
    texts, ids, reason = [], [], None
    try:
        while reason is None:
            piece = await pieces.next()
            texts.append(piece.text)
            ids += piece.ids
            reason = piece.finish_reason
    finally:
        pieces.close()
    text = "".join(texts)
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if return_ids:
        choice["token_ids"] = ids
        choice["prompt_token_ids"] = prompt
    usage = usage_of(len(prompt), len(ids), pieces.ticket.cached_tokens)
    kind = "chat.completion" if chat else "text_completion"
    return {**head, "object": kind, "choices": [choice], "usage": usage}
