"""The engine loop: one thread owns the :class:`~piecegraph.serve.Engine`; HTTP handlers talk to it through a
thread-safe inbox and get their tokens back on their asyncio loop.

Per iteration the thread takes what the inbox holds (new requests, aborts), runs one engine step, and hands every
request's new tokens to the asyncio side in one ``call_soon_threadsafe`` per step (not one per request: at 1024
running requests that wake-up is the cost). A handler that falls behind finds several events queued and sends
them as one chunk. Nothing a client sends reaches the engine unvalidated, and an exception from the engine fails
the requests in flight, not the thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from piecegraph.serve.engine import Engine
from piecegraph.serve.gc_pauses import frozen_heap
from piecegraph.serve.request import Request, SamplingParams
from piecegraph.serve.stats import PHASES

log = logging.getLogger("piecegraph.server")


class QueueFull(Exception):
    """The server holds as many requests as it admits (a 429 with ``Retry-After``)."""


class Closed(Exception):
    """The loop is shutting down or stopped (a 503)."""


@dataclass(slots=True)  # one per streamed token on both sides of the engine pipe: slots make it ~30% cheaper
class Event:
    """What a handler learns: new output ids, the engine's finish reason once finished (``eos``, ``length``,
    ``aborted``), or an ``error`` (the engine refused the request: ``ValueError``/``TypeError`` text; or failed)."""

    ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    refused: bool = False  # the engine refused it at add_request (a client error), not a failure
    at: float = 0.0  # perf_counter when the engine loop published it


@dataclass(eq=False)
class Ticket:
    """A submitted request, as its handler holds it: ``events`` is filled on the handler's asyncio loop (both
    ``None`` where a sink other than the asyncio one delivers the events: the engine process)."""

    id: str
    prompt: list[int]
    params: SamplingParams
    events: asyncio.Queue | None = None
    aloop: asyncio.AbstractEventLoop | None = None
    arrival: float = field(default_factory=time.perf_counter)
    request: Request | None = None  # the engine's request (engine thread only)
    sent: int = 0  # output ids received (front end of an engine process only)
    done: bool = False
    cached_tokens: int | None = None  # prompt tokens the prefix cache held, set before the first token's event


class EngineLoop:
    """Runs ``engine`` on its own thread. ``max_pending``: requests admitted at once (running and waiting);
    one more is refused with :class:`QueueFull`. ``metrics``: a :class:`~piecegraph.server.metrics.Metrics` the
    loop writes steps and KV pages to. Use :meth:`start`, :meth:`submit`/:meth:`abort` from an asyncio loop, and
    :meth:`close` (finish what is running for up to ``drain_s``, abort the rest, log which). ``sink``: where
    each iteration's ``(ticket, event)`` pairs go (default: the tickets' asyncio queues). ``step_sink``: where a
    step's new tokens go instead, called as ``step_sink(requests, tokens, finished, at, cached)`` with the engine's
    :attr:`~piecegraph.serve.Engine.emitted` lists, the requests that finished in the step (each also in
    ``requests``, with its last token), the publish time and ``{request id: cached prompt tokens}`` of the
    requests whose first token this is (empty without a prefix cache), set on their tickets before their first
    event (default: made into events for ``sink``); the engine
    process sends the lists on as they are, since building an :class:`Event` per token cost ~1 of the ~3 us per
    token its loop spent publishing (3 ms per step at 1024)."""

    def __init__(self, engine: Engine, *, max_pending: int, metrics: Any = None, name: str = "engine-loop",
                 sink: Callable[[list[tuple[Ticket, Event]]], None] | None = None, inbox: Any = None,
                 step_sink: Callable[[list[Request], list[int], list[Request], float, dict], None] | None = None
                 ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending!r} must be >= 1")
        self.engine, self.max_pending, self.metrics = engine, max_pending, metrics
        self._sink = sink or self._to_asyncio
        self._step_sink = step_sink or self._as_events
        # Commands for the engine thread: put / get / get_nowait as queue.SimpleQueue's (the engine process passes
        # one that reads its command pipe, remote.py)
        self._inbox = inbox if inbox is not None else queue.SimpleQueue()
        self._live: dict[str, Ticket] = {}  # engine thread only
        self._lock = threading.Lock()
        self._pending = 0  # admitted and not yet retired (guarded by _lock)
        self._started_ids = 0  # live tickets with a first token (read racily for gauges: fine)
        self._ids = itertools.count()
        self._closing = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self.run, name=name, daemon=True)
        self.finished_at_close: list[str] = []
        self.aborted_at_close: list[str] = []
        self._steps_seen = 0
        self._prefix_cache = getattr(getattr(engine, "scheduler", None), "prefix", None) is not None
        # OpenMP's thread count is per thread: a new thread would get the default (every core) and spin against
        # the HTTP threads. The engine thread uses what its creator set (torch.set_num_threads, OMP_NUM_THREADS).
        self._torch_threads = torch.get_num_threads()

    # -- handler side (any thread) ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, prompt: list[int], params: SamplingParams, *, prefix: str = "req") -> Ticket:
        """Admit a request: the first event says whether the engine accepted it. Call on the asyncio loop that
        will read ``ticket.events``. Raises :class:`QueueFull` or :class:`Closed`."""
        if self._closing.is_set():
            raise Closed("the server is shutting down")
        with self._lock:
            if self._pending >= self.max_pending:
                raise QueueFull(f"{self._pending} requests are in flight, the most this server admits")
            self._pending += 1
        ticket = Ticket(f"{prefix}-{next(self._ids)}", prompt, params, asyncio.Queue(), asyncio.get_running_loop())
        self._inbox.put(("add", ticket))
        return ticket

    def abort(self, ticket: Ticket) -> None:
        """Abort ``ticket`` (a client went away, a stop string matched): its pages are freed by the next
        iteration. Idempotent; a finished ticket is left alone."""
        if not ticket.done:
            self._inbox.put(("abort", ticket))

    def enqueue(self, ticket: Ticket) -> None:
        """Queue ``ticket`` without admission control (the engine process: its parent admits)."""
        with self._lock:
            self._pending += 1
        self._inbox.put(("add", ticket))

    def abort_id(self, request_id: str) -> None:
        """:meth:`abort` by id (the engine process gets ids over its pipe)."""
        self._inbox.put(("abort", request_id))

    def load(self) -> dict[str, float]:
        """Gauges for ``/metrics``: waiting and running requests, KV pages used and total."""
        cache = self.engine.cache
        pending, running = self._pending, self._started_ids
        return {"piecegraph_requests_waiting": max(0, pending - running), "piecegraph_requests_running": running,
                "piecegraph_kv_pages_used": cache.num_pages - 1 - cache.num_free_pages,
                "piecegraph_kv_pages_total": cache.num_pages - 1}

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def begin_close(self) -> None:
        """Shutdown starts: refuse new requests (:class:`Closed`); requests in flight keep running."""
        if not self._closing.is_set():
            log.info("shutting down: %d requests in flight; new requests get 503", self._pending)
        self._closing.set()

    def close(self, drain_s: float = 30.0) -> None:
        """Refuse new requests, let the engine finish what it holds for up to ``drain_s`` seconds, then abort the
        rest; logs (and keeps in ``finished_at_close`` / ``aborted_at_close``) which ids. Blocks until done."""
        self.begin_close()
        self._inbox.put(("wake", None))
        self._stopped.wait(drain_s)
        self._inbox.put(("stop", None))
        self._thread.join(timeout=max(5.0, drain_s))
        if self.finished_at_close:
            log.info("finished during shutdown: %s", ", ".join(self.finished_at_close))
        if self.aborted_at_close:
            log.warning("aborted at shutdown: %s", ", ".join(self.aborted_at_close))

    @property
    def stopped(self) -> bool:
        """Closing, and nothing left to run: the loop stops at its next command."""
        return self._stopped.is_set()

    # -- engine thread ----------------------------------------------------------------------------------
    def run(self) -> None:
        """The loop itself, on the calling thread, until a ``stop`` command (:meth:`start` runs it on its own
        thread; the engine process runs it on its main thread). The heap that exists when it starts is frozen
        while it runs (``EngineConfig.freeze_gc``)."""
        torch.set_num_threads(self._torch_threads)
        device = getattr(self.engine, "device", None)
        if isinstance(device, torch.device) and device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # the current device is per thread too
        with frozen_heap(getattr(getattr(self.engine, "config", None), "freeze_gc", False)):
            self._loop()
        self._abort_all_at_stop()
        self._stopped.set()

    def _loop(self) -> None:
        clock = time.perf_counter
        while True:
            idle = not self.engine.has_work()
            if self._closing.is_set() and idle and not self._live:
                self._stopped.set()
            began = clock()
            if not self._take_inbox(block=idle):
                break
            taken = clock()
            self._spent("idle" if idle else "commands", taken - began)
            if not self.engine.has_work():
                self.engine.idle_work()  # a swap a background package brought, between requests rather than in one
                continue
            try:
                finished = self.engine.step()
            except Exception as err:  # an engine bug must not take the server down: fail who was in flight
                log.exception("engine step failed; failing %d requests in flight", len(self._live))
                self._fail_all(f"the engine failed: {type(err).__name__}: {err}")
                finished = None
            stepped = clock()
            self._count_steps()
            if finished is not None:
                self._publish(finished)
            self._spent("step", stepped - taken)
            self._spent("publish", clock() - stepped)

    def _spent(self, part: str, seconds: float) -> None:
        """Where the loop's wall time goes (``/metrics``, ``serve-bench --url``): which part of a step is on the
        critical path when the server falls behind the in-process engine."""
        if self.metrics is not None:
            self.metrics.inc("piecegraph_engine_loop_seconds_total", seconds, part=part)

    def _take_inbox(self, block: bool) -> bool:
        """Apply queued commands; ``False`` when told to stop. Blocks for the first one when idle."""
        acks: list[tuple[Ticket, Event]] = []
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                kind, ticket = item
                if kind == "stop":
                    self._send(acks)
                    return False
                if kind == "add":
                    acks.append((ticket, self._add(ticket)))
                elif kind == "abort":  # a Ticket, or its id (from the engine process's pipe)
                    self._abort(self._live.get(ticket, None) if isinstance(ticket, str) else ticket)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass
        self._send(acks)
        return True

    def _add(self, ticket: Ticket) -> Event:
        try:
            ticket.request = self.engine.add_request(ticket.prompt, ticket.params, id=ticket.id)
        except (TypeError, ValueError) as err:
            self._retire(ticket)
            return Event([], error=str(err), refused=True)
        self._live[ticket.id] = ticket
        return Event([])

    def _abort(self, ticket: Ticket | None, notify: bool = True) -> None:
        """Abort in the engine (pages freed now); ``notify`` tells the handler it ended (``aborted``)."""
        if ticket is None or ticket.done or ticket.id not in self._live:
            return
        try:
            self.engine.abort(ticket.id)
        except KeyError:
            pass
        del self._live[ticket.id]
        self._retire(ticket)
        if notify:
            self._send([(ticket, Event([], finish_reason="aborted", at=time.perf_counter()))])

    def _retire(self, ticket: Ticket) -> None:
        if ticket.done:
            return
        ticket.done = True
        if ticket.request is not None and ticket.request.output:  # its first token was published
            self._started_ids -= 1
        with self._lock:
            self._pending -= 1

    def _publish(self, finished: list[Request]) -> None:
        """The step's new tokens (the engine's :attr:`~piecegraph.serve.Engine.emitted`, one per request) and its
        finished requests to the handlers, then retire the finished. No scan of every live request: at 1000+
        running requests that scan, a row object per request and routing them cost ~0.5 ms a step."""
        requests, tokens = self.engine.emitted
        if requests:
            first = [r for r in requests if len(r.output) == 1]
            cached = {}
            if first:
                self._started_ids += len(first)
                for request in first:
                    self._first_token(request)
                if self._prefix_cache:
                    cached = {r.id: r.cached_tokens for r in first}
            self._step_sink(requests, tokens, finished, time.perf_counter(), cached)
        for request in finished:
            ticket = self._live.pop(request.id, None)
            if ticket is None:
                continue
            self._retire(ticket)
            if self._closing.is_set():
                self.finished_at_close.append(ticket.id)
                log.info("%s finished during shutdown (%s, %d tokens)", ticket.id, request.finish_reason,
                         len(request.output))

    def _first_token(self, request: Any) -> None:
        """The engine's own share of a request's TTFT (taken to first token on the host), for ``/metrics``: what
        HTTP adds is the front end's TTFT minus this."""
        if self.metrics is not None and request.first_token is not None:
            self.metrics.inc("piecegraph_engine_time_to_first_token_seconds_total",
                             request.first_token - request.arrival)
            self.metrics.inc("piecegraph_engine_first_tokens_total")

    def _as_events(self, requests: list[Request], tokens: list[int], finished: list[Request], at: float,
                   cached: dict) -> None:
        live, events = self._live, []
        for rid, n in cached.items():  # set before the first event is posted: the handler reads it after that
            ticket = live.get(rid)
            if ticket is not None:
                ticket.cached_tokens = n
        for request, token in zip(requests, tokens):
            ticket = live.get(request.id)
            if ticket is not None:
                events.append((ticket, Event([token], request.finish_reason, at=at)))
        self._send(events)

    def _send(self, events: list[tuple[Ticket, Event]]) -> None:
        if events:
            self._sink(events)

    def _to_asyncio(self, events: list[tuple[Ticket, Event]]) -> None:
        post_events(events, lambda ticket: self._abort(ticket, notify=False))

    def _fail_all(self, message: str) -> None:
        failed = list(self._live.values())
        for ticket in failed:
            self._abort(ticket, notify=False)
        self._send([(t, Event([], error=message)) for t in failed])

    def _abort_all_at_stop(self) -> None:
        self._take_inbox(block=False)  # requests that raced the stop are refused below too
        left = list(self._live.values())
        for ticket in left:
            self._abort(ticket, notify=False)
            self.aborted_at_close.append(ticket.id)
        self._send([(t, Event([], finish_reason="aborted", at=time.perf_counter())) for t in left])

    def _count_steps(self) -> None:
        steps = getattr(self.engine, "steps", None)
        if not isinstance(steps, list):
            return
        if self.metrics is not None:
            phases = [0.0] * len(PHASES)
            for record in steps[self._steps_seen:]:
                self.metrics.inc("piecegraph_engine_steps_total", kind=str(getattr(record, "kind", "unknown")))
                for i, seconds in enumerate(getattr(record, "phases", ())):
                    phases[i] += seconds
            if any(phases):
                for name, seconds in zip(PHASES, phases):
                    self.metrics.inc("piecegraph_engine_step_phase_seconds_total", seconds, phase=name)
        self._steps_seen = len(steps)
        if self._steps_seen > 10_000:  # a server runs for days: keep the engine's per-step records bounded
            self.engine.reset_stats()
            self._steps_seen = 0


def post_events(events: list[tuple[Ticket, Event]], on_closed: Callable[[Ticket], None]) -> None:
    """Hand each ticket its event on the ticket's asyncio loop (thread-safe, one callback per loop); a ticket whose
    loop is closed (its handler is gone) goes to ``on_closed`` instead, to be aborted."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Ticket, Event]]] = {}
    for ticket, event in events:
        by_loop.setdefault(ticket.aloop, []).append((ticket, event))
    for aloop, batch in by_loop.items():
        try:
            aloop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:
            for ticket, _ in batch:
                on_closed(ticket)


def _deliver(batch: list[tuple[Ticket, Event]]) -> None:
    for ticket, event in batch:
        ticket.events.put_nowait(event)
