"""The engine loop in its own process: the HTTP front end and the engine then hold separate interpreter locks.

In one process the handlers' per-token work (detokenizing, JSON, socket writes) competes with the engine's host
work for the GIL, and the engine is host-bound on a GPU, so every microsecond the front end spends is lost
throughput. Here the child process runs an :class:`~piecegraph.server.loop.EngineLoop` whose sink pickles each
iteration's events (ids, new token ids, finish) as ONE message onto a pipe. The front end keeps the same interface
(``submit``, ``abort``, ``load``, ``close``).

No thread sits between the two loops, because every thread hop costs a wake-up and, worse, a wait for the GIL
(up to the 5 ms switch interval when the other thread is busy: that was the extra TTFT at concurrency 1 and the
token bursts under load). The child's engine thread reads the command pipe itself between steps (blocking on it
only when idle); the server reads the event pipe on its asyncio loop (``add_reader``: the first loop that
submits), so a step's events reach the handlers' queues in one callback with no ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import queue
import select
import struct
import threading
import time
import traceback
from collections import Counter, deque
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import torch

from piecegraph.serve.request import SamplingParams
from piecegraph.server.loop import Closed, Event, QueueFull, Ticket, post_events

log = logging.getLogger("piecegraph.server")


class ProcessEngineLoop:
    """An engine built by ``factory()`` (a picklable callable: the child imports and calls it) in a spawned child
    process. :meth:`start` blocks until the engine is built and its graphs captured, then :attr:`info` holds its
    limits (``max_seq_len``, ``vocab_size``, ``max_num_seqs``, ``setup_s``). ``max_pending`` and ``metrics`` as
    for :class:`~piecegraph.server.loop.EngineLoop`. :meth:`submit` and :meth:`abort` run on one asyncio loop
    (the first to submit reads the events; tickets of another loop get theirs thread-safely through it, so that
    loop must keep running); :meth:`close` runs off that loop (``asyncio.to_thread``) or after it stopped."""

    def __init__(self, factory: Callable[[], Any], *, max_pending: int | None = None, metrics: Any = None) -> None:
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked; spawn also starts the child clean
        self._cmd_recv, self._cmd_send = ctx.Pipe(duplex=False)
        self._ev_recv, self._ev_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, args=(factory, self._cmd_recv, self._ev_send, torch.get_num_threads()),
                                 name="piecegraph-engine", daemon=True)
        self.max_pending, self.metrics = max_pending or 0, metrics
        self.info: dict[str, Any] = {}
        self._tickets: dict[str, Ticket] = {}
        self._lock = threading.Lock()  # guards _tickets and _pending (the command pipe has its own)
        self._pending = self._running = 0
        self._ids = itertools.count()
        self._closing = self._eof = False
        self._snapshot = {"used": 0, "total": 0}
        self._aloop: asyncio.AbstractEventLoop | None = None  # the loop whose add_reader reads the event pipe
        self._closed = threading.Event()
        self.finished_at_close: list[str] = []
        self.aborted_at_close: list[str] = []

    def start(self) -> None:
        """Start the child and wait until its engine is ready; raises ``RuntimeError`` with the child's error."""
        self._proc.start()
        self._cmd_recv.close()
        self._ev_send.close()
        self._cmd = _CommandWriter(self._cmd_send)
        try:
            kind, payload = self._ev_recv.recv()
        except EOFError:
            raise RuntimeError(f"the engine process exited (code {self._proc.exitcode}) before it was ready") from None
        if kind != "ready":
            raise RuntimeError(f"the engine process failed to start:\n{payload}")
        self.info = payload
        self.max_pending = self.max_pending or 4 * payload["max_num_seqs"]
        self._snapshot = {"used": 0, "total": payload["num_pages"] - 1}

    @property
    def alive(self) -> bool:
        return not self._eof and not self._closed.is_set() and self._proc.is_alive()

    def submit(self, prompt: list[int], params: SamplingParams, *, prefix: str = "req") -> Ticket:
        """As :meth:`EngineLoop.submit <piecegraph.server.loop.EngineLoop.submit>`."""
        if self._closing or not self.alive:
            raise Closed("the server is shutting down" if self._closing else "the engine process is not running")
        aloop = asyncio.get_running_loop()
        if self._aloop is None:
            self._aloop = aloop
            aloop.add_reader(self._ev_recv.fileno(), self._on_readable)
        ticket = Ticket(f"{prefix}-{next(self._ids)}", prompt, params, asyncio.Queue(), aloop)
        with self._lock:
            if self._pending >= self.max_pending:
                raise QueueFull(f"{self._pending} requests are in flight, the most this server admits")
            self._pending += 1
            self._tickets[ticket.id] = ticket
        self._cmd.send(("add", ticket.id, prompt, params), aloop)
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
        aloop = self._aloop
        if aloop is not None and aloop.is_running() and not _running_on(aloop):
            self._closed.wait(drain_s + 30)  # the loop's reader takes the rest, "closed" included
        else:  # no loop reads the pipe (none submitted, or it stopped): read it here
            if aloop is not None and not aloop.is_closed():
                aloop.remove_reader(self._ev_recv.fileno())
            self._aloop = None
            deadline = time.monotonic() + drain_s + 30
            while not self._closed.is_set() and not self._eof and time.monotonic() < deadline:
                readable = self._cmd.flush_while_reading(self._ev_recv, deadline)
                if readable and self._ev_recv.poll():
                    self._read_one()
            self._fail_left()
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            log.warning("the engine process did not stop; terminating it")
            self._proc.terminate()
        if self.finished_at_close:
            log.info("finished during shutdown: %s", ", ".join(self.finished_at_close))
        if self.aborted_at_close:
            log.warning("aborted at shutdown: %s", ", ".join(self.aborted_at_close))

    def _command(self, message: tuple) -> None:
        self._cmd.send(message, self._aloop)

    def _on_readable(self) -> None:
        """The event pipe is readable (asyncio loop): take every whole message there is, each a step's events."""
        while not self._eof and not self._closed.is_set() and self._ev_recv.poll():
            self._read_one()
        if self._eof or self._closed.is_set():
            self._aloop.remove_reader(self._ev_recv.fileno())
            self._fail_left()

    def _read_one(self) -> None:
        try:
            message = self._ev_recv.recv()
        except (EOFError, OSError):
            self._eof = True
            return
        if message[0] == "events":
            _, events, snapshot, kinds = message
            self._snapshot = snapshot
            self._dispatch(events)
            if self.metrics is not None:
                for kind, n in kinds.items():
                    self.metrics.inc("piecegraph_engine_steps_total", n, kind=kind)
        elif message[0] == "closed":
            self.finished_at_close, self.aborted_at_close = message[1], message[2]
            self._closed.set()

    def _fail_left(self) -> None:
        with self._lock:
            left = list(self._tickets.values())
        if left:
            self._dispatch([(t.id, [], None, "the engine process stopped", False) for t in left])

    def _dispatch(self, events: list[tuple]) -> None:
        """One step's events to their handlers' queues: directly for tickets of the running loop (this is it)."""
        now, other = time.perf_counter(), []
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
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
                event = Event(ids, reason, error, refused, now)
                if ticket.aloop is here:
                    ticket.events.put_nowait(event)
                else:
                    other.append((ticket, event))
        if other:
            post_events(other, self.abort)


class _CommandWriter:
    """The server's end of the command pipe, in ``multiprocessing.Connection``'s wire format (a 4-byte length,
    then the pickle), written without ever blocking the asyncio loop. A blocking ``Connection.send`` deadlocked at
    a few hundred concurrent submits: the pipe filled while the child's engine thread was itself blocked sending
    events the (blocked) loop no longer read. What does not fit now is buffered and written when the pipe is
    writable (``add_writer`` on ``aloop``, from any thread). Order is kept; a gone child drops the bytes (the
    event pipe's EOF fails what was in flight)."""

    def __init__(self, conn: Any) -> None:
        self.conn, self.fd = conn, conn.fileno()
        os.set_blocking(self.fd, False)  # the write end only: the child's read end is its own file description
        self.buf = bytearray()
        self.lock = threading.Lock()
        self.armed: asyncio.AbstractEventLoop | None = None  # the loop whose writer callback flushes ``buf``

    def send(self, message: tuple, aloop: asyncio.AbstractEventLoop | None) -> None:
        data = ForkingPickler.dumps(message)
        frame = struct.pack("!i", len(data)) + data
        with self.lock:
            if not self.buf:
                frame = frame[self._write(frame):]
                if not frame:
                    return
            self.buf += frame
            if self.armed is None and aloop is not None and aloop.is_running():
                self.armed = aloop
                if _running_on(aloop):
                    aloop.add_writer(self.fd, self._on_writable)
                else:
                    aloop.call_soon_threadsafe(aloop.add_writer, self.fd, self._on_writable)

    def _write(self, data: bytes | bytearray) -> int:
        try:
            return os.write(self.fd, data)
        except BlockingIOError:
            return 0
        except OSError:  # the child is gone
            return len(data)

    def _on_writable(self) -> None:
        with self.lock:
            del self.buf[:self._write(self.buf)]
            if not self.buf and self.armed is not None:
                self.armed.remove_writer(self.fd)
                self.armed = None

    def flush_while_reading(self, events: Any, deadline: float) -> bool:
        """Off the loop (it stopped): write what is buffered while waiting for ``events`` to be readable (the
        child may be blocked sending them); ``True`` once it is, ``False`` at ``deadline``."""
        with self.lock:
            if self.armed is not None and not self.armed.is_closed():
                self.armed.remove_writer(self.fd)
            self.armed = None
        while True:
            with self.lock:
                writers = [self.fd] if self.buf else []
            readable, writable, _ = select.select([events.fileno()], writers, [], max(0.0, deadline - time.monotonic()))
            if writable:
                with self.lock:
                    del self.buf[:self._write(self.buf)]
            if readable or time.monotonic() >= deadline:
                return bool(readable)


def _running_on(aloop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is aloop
    except RuntimeError:
        return False


class _KindCounter:
    """Stands in for metrics in the child: counts steps by kind until the next event batch takes them."""

    def __init__(self) -> None:
        self.kinds: Counter = Counter()

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self.kinds[labels.get("kind", "unknown")] += int(value)

    def take(self) -> dict[str, int]:
        out, self.kinds = dict(self.kinds), Counter()
        return out


class _PipeInbox:
    """The child's :class:`EngineLoop` inbox, read by the engine thread straight from the command pipe (``get`` /
    ``get_nowait`` as ``queue.SimpleQueue``'s): no thread in between, so a command never waits for the GIL.
    ``close`` sets a drain deadline: ``stop`` once the loop is idle or the deadline passed (once; after it, what
    is still in the pipe is handed over, so requests that raced the close are aborted as in-process); EOF (the
    server process died) stops at once."""

    def __init__(self, conn: Any) -> None:
        self.conn, self.local = conn, deque()
        self.loop: Any = None  # the EngineLoop reading this inbox (set once it is built)
        self.deadline: float | None = None
        self.stopping = False

    def put(self, item: tuple) -> None:
        self.local.append(item)

    def get_nowait(self) -> tuple:
        return self.get(0.0)

    def get(self, timeout: float = 0.0) -> tuple:
        if self.local:
            return self.local.popleft()
        if self.deadline is not None and not self.stopping:
            now = time.monotonic()
            if self.loop.stopped or now >= self.deadline:
                self.stopping = True
                return ("stop", None)
            timeout = min(timeout, self.deadline - now)
        try:
            if not self.conn.poll(timeout):
                raise queue.Empty
            message = self.conn.recv()
        except (EOFError, OSError):
            if self.stopping:
                raise queue.Empty from None
            self.deadline, self.stopping = 0.0, True
            return ("stop", None)
        kind = message[0]
        if kind == "add":  # through the loop's own methods, which put their command here
            self.loop.enqueue(Ticket(message[1], message[2], message[3]))
        elif kind == "abort":
            self.loop.abort_id(message[1])
        else:
            self.loop.begin_close()  # begin_close, or close (with its drain)
            if kind == "close":
                self.deadline = time.monotonic() + message[1]
        return self.local.popleft() if self.local else ("wake", None)


def _child(factory: Callable[[], Any], commands: Any, events: Any, threads: int) -> None:
    """The engine process: build the engine, then run its loop on this thread until told to close."""
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
    cache, kinds = engine.cache, _KindCounter()

    def send(payload: list[tuple]) -> None:
        snapshot = {"used": cache.num_pages - 1 - cache.num_free_pages, "total": cache.num_pages - 1}
        events.send(("events", payload, snapshot, kinds.take()))

    def sink(batch: list[tuple[Ticket, Event]]) -> None:
        send([(t.id, e.ids, e.finish_reason, e.error, e.refused) for t, e in batch])

    def step_sink(rows: list[tuple[Ticket, list[int], str | None]], at: float) -> None:
        send([(t.id, ids, reason, None, False) for t, ids, reason in rows])  # the server stamps its own time

    inbox = _PipeInbox(commands)
    loop = inbox.loop = EngineLoop(engine, max_pending=1 << 30, metrics=kinds, sink=sink, inbox=inbox,
                                   step_sink=step_sink)  # the parent admits
    config = engine.config
    events.send(("ready", {"max_seq_len": config.max_seq_len or engine.model.config.max_seq_len,
                           "vocab_size": engine.model.config.vocab_size, "max_num_seqs": config.max_num_seqs,
                           "num_pages": cache.num_pages, "setup_s": engine.setup_s}))
    loop.run()  # on this thread: it reads the command pipe itself (see _PipeInbox)
    events.send(("closed", loop.finished_at_close, loop.aborted_at_close))
