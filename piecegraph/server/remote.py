"""The engine loop in its own process: the HTTP front end and the engine then hold separate interpreter locks.

In one process the handlers' per-token work (detokenizing, JSON, socket writes) competes with the engine's host
work for the GIL, and the engine is host-bound on a GPU, so every microsecond the front end spends is lost
throughput. Here the child process runs an :class:`~piecegraph.server.loop.EngineLoop` whose sink pickles each
iteration's events (ids, new token ids, finish) onto a pipe; a reader thread in the server process hands them to
the handlers' asyncio loops. The front end keeps the same interface (``submit``, ``abort``, ``load``, ``close``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import threading
import time
import traceback
from collections import Counter
from typing import Any, Callable

import torch

from piecegraph.serve.request import SamplingParams
from piecegraph.server.loop import Closed, Event, QueueFull, Ticket, post_events

log = logging.getLogger("piecegraph.server")


class ProcessEngineLoop:
    """An engine built by ``factory()`` (a picklable callable: the child imports and calls it) in a spawned child
    process. :meth:`start` blocks until the engine is built and its graphs captured, then :attr:`info` holds its
    limits (``max_seq_len``, ``vocab_size``, ``max_num_seqs``, ``setup_s``). ``max_pending`` and ``metrics`` as
    for :class:`~piecegraph.server.loop.EngineLoop`."""

    def __init__(self, factory: Callable[[], Any], *, max_pending: int | None = None, metrics: Any = None) -> None:
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked; spawn also starts the child clean
        self._cmd_recv, self._cmd_send = ctx.Pipe(duplex=False)
        self._ev_recv, self._ev_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, args=(factory, self._cmd_recv, self._ev_send, torch.get_num_threads()),
                                 name="piecegraph-engine", daemon=True)
        self.max_pending, self.metrics = max_pending or 0, metrics
        self.info: dict[str, Any] = {}
        self._tickets: dict[str, Ticket] = {}
        self._lock = threading.Lock()  # guards _tickets, _pending and the command pipe
        self._pending = self._running = 0
        self._ids = itertools.count()
        self._closing = False
        self._snapshot = {"used": 0, "total": 0}
        self._reader = threading.Thread(target=self._read, name="engine-events", daemon=True)
        self.finished_at_close: list[str] = []
        self.aborted_at_close: list[str] = []

    def start(self) -> None:
        """Start the child and wait until its engine is ready; raises ``RuntimeError`` with the child's error."""
        self._proc.start()
        self._cmd_recv.close()
        self._ev_send.close()
        try:
            kind, payload = self._ev_recv.recv()
        except EOFError:
            raise RuntimeError(f"the engine process exited (code {self._proc.exitcode}) before it was ready") from None
        if kind != "ready":
            raise RuntimeError(f"the engine process failed to start:\n{payload}")
        self.info = payload
        self.max_pending = self.max_pending or 4 * payload["max_num_seqs"]
        self._snapshot = {"used": 0, "total": payload["num_pages"] - 1}
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._reader.is_alive() and self._proc.is_alive()

    def submit(self, prompt: list[int], params: SamplingParams, *, prefix: str = "req") -> Ticket:
        """As :meth:`EngineLoop.submit <piecegraph.server.loop.EngineLoop.submit>`."""
        if self._closing or not self.alive:
            raise Closed("the server is shutting down" if self._closing else "the engine process is not running")
        ticket = Ticket(f"{prefix}-{next(self._ids)}", prompt, params, asyncio.Queue(), asyncio.get_running_loop())
        with self._lock:
            if self._pending >= self.max_pending:
                raise QueueFull(f"{self._pending} requests are in flight, the most this server admits")
            self._pending += 1
            self._tickets[ticket.id] = ticket
            self._cmd_send.send(("add", ticket.id, prompt, params))
        return ticket

    def abort(self, ticket: Ticket) -> None:
        if not ticket.done:
            self._command(("abort", ticket.id))

    def load(self) -> dict[str, float]:
        running, snap = self._running, self._snapshot
        return {"piecegraph_requests_waiting": max(0, self._pending - running), "piecegraph_requests_running": running,
                "piecegraph_kv_pages_used": snap["used"], "piecegraph_kv_pages_total": snap["total"]}

    def begin_close(self) -> None:
        if not self._closing:
            log.info("shutting down: %d requests in flight; new requests get 503", self._pending)
        self._closing = True
        self._command(("begin_close",))

    def close(self, drain_s: float = 30.0) -> None:
        """Drain for up to ``drain_s`` seconds, abort the rest, stop the child; logs which requests were which."""
        self.begin_close()
        self._command(("close", drain_s))
        self._reader.join(timeout=drain_s + 30)
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            log.warning("the engine process did not stop; terminating it")
            self._proc.terminate()
        if self.finished_at_close:
            log.info("finished during shutdown: %s", ", ".join(self.finished_at_close))
        if self.aborted_at_close:
            log.warning("aborted at shutdown: %s", ", ".join(self.aborted_at_close))

    def _command(self, message: tuple) -> None:
        with self._lock:
            try:
                self._cmd_send.send(message)
            except (OSError, ValueError):  # the child is gone: the reader fails what was in flight
                pass

    def _read(self) -> None:
        while True:
            try:
                message = self._ev_recv.recv()
            except (EOFError, OSError):
                break
            if message[0] == "events":
                _, events, snapshot, kinds = message
                self._snapshot = snapshot
                self._dispatch(events)
                if self.metrics is not None:
                    for kind, n in kinds.items():
                        self.metrics.inc("piecegraph_engine_steps_total", n, kind=kind)
            elif message[0] == "closed":
                self.finished_at_close, self.aborted_at_close = message[1], message[2]
                break
        with self._lock:
            left = list(self._tickets.values())
        self._dispatch([(t.id, [], None, "the engine process stopped", False) for t in left])

    def _dispatch(self, events: list[tuple]) -> None:
        now, out = time.perf_counter(), []
        with self._lock:
            for rid, ids, reason, error, refused in events:
                ticket = self._tickets.get(rid)
                if ticket is None:
                    continue
                if ids and not ticket.sent:
                    self._running += 1
                ticket.sent += len(ids)
                if reason or error:
                    del self._tickets[rid]
                    ticket.done = True
                    self._pending -= 1
                    self._running -= 1 if ticket.sent else 0
                out.append((ticket, Event(ids, reason, error, refused, at=now)))
        post_events(out, self.abort)


class _KindCounter:
    """Stands in for metrics in the child: counts steps by kind until the next event batch takes them."""

    def __init__(self) -> None:
        self.kinds: Counter = Counter()

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self.kinds[labels.get("kind", "unknown")] += int(value)

    def take(self) -> dict[str, int]:
        out, self.kinds = dict(self.kinds), Counter()
        return out


def _child(factory: Callable[[], Any], commands: Any, events: Any, threads: int) -> None:
    """The engine process: build the engine, then apply commands until told to close."""
    import signal

    from piecegraph.server.loop import EngineLoop

    # Ctrl-C reaches the whole process group: the server process drains and then tells this one to close.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    try:
        engine = factory()
    except BaseException:  # noqa: BLE001  (the parent shows the child's error and exits)
        events.send(("failed", traceback.format_exc()))
        return
    cache, kinds, send_lock = engine.cache, _KindCounter(), threading.Lock()

    def sink(batch: list[tuple[Ticket, Event]]) -> None:
        snapshot = {"used": cache.num_pages - 1 - cache.num_free_pages, "total": cache.num_pages - 1}
        payload = [(t.id, e.ids, e.finish_reason, e.error, e.refused) for t, e in batch]
        with send_lock:
            events.send(("events", payload, snapshot, kinds.take()))

    loop = EngineLoop(engine, max_pending=1 << 30, metrics=kinds, sink=sink)  # the parent admits
    config = engine.config
    events.send(("ready", {"max_seq_len": config.max_seq_len or engine.model.config.max_seq_len,
                           "vocab_size": engine.model.config.vocab_size, "max_num_seqs": config.max_num_seqs,
                           "num_pages": cache.num_pages, "setup_s": engine.setup_s}))
    loop.start()
    while True:
        try:
            message = commands.recv()
        except EOFError:  # the server process died: stop now
            message = ("close", 0.0)
        if message[0] == "add":
            _, rid, prompt, params = message
            loop.enqueue(Ticket(rid, prompt, params))
        elif message[0] == "abort":
            loop.abort_id(message[1])
        elif message[0] == "begin_close":
            loop.begin_close()
        elif message[0] == "close":
            loop.close(message[1])
            with send_lock:
                events.send(("closed", loop.finished_at_close, loop.aborted_at_close))
            return
