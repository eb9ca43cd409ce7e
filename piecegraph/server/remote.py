"""The engine loop in its own process: the HTTP front end and the engine then hold separate interpreter locks.

In one process the handlers' per-token work (detokenizing, JSON, socket writes) competes with the engine's host
work for the GIL, and the engine is host-bound on a GPU, so every microsecond the front end spends is lost
throughput. Here the child process runs an :class:`~piecegraph.server.loop.EngineLoop` whose sink pickles each
iteration's events (ids, new token ids, finish) as ONE message onto a pipe. The front end keeps the same interface
(``submit``, ``abort``, ``load``, ``close``). Several front-end processes can share one engine process
(``piecegraph serve --api-servers N``): each has its own pipe pair, and the child routes each request's events to
the front end that sent it (:mod:`piecegraph.server.engine_child`).

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
import select
import struct
import threading
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import torch

from piecegraph.serve.request import SamplingParams
from piecegraph.server.engine_child import engine_main
from piecegraph.server.loop import Closed, Event, QueueFull, Ticket, post_events

log = logging.getLogger("piecegraph.server")


class ProcessEngineLoop:
    """An engine built by ``factory()`` (a picklable callable: the child imports and calls it) in a spawned child
    process. :meth:`start` blocks until the engine is built and its graphs captured, then :attr:`info` holds its
    limits (``max_seq_len``, ``vocab_size``, ``max_num_seqs``, ``num_pages``, ``setup_s``). ``max_pending`` and
    ``metrics`` as for :class:`~piecegraph.server.loop.EngineLoop`. :meth:`submit` and :meth:`abort` run on one
    asyncio loop (the first to submit reads the events; tickets of another loop get theirs thread-safely through
    it, so that loop must keep running); :meth:`close` runs off that loop (``asyncio.to_thread``) or after it
    stopped. ``frontends``: how many front-end processes the engine serves; this object is front end 0, and
    :attr:`peer_channels` holds the other front ends' pipe ends, each for :meth:`attach` in its own process.
    ``engine_cpus``: the CPUs the engine process runs on (:mod:`piecegraph.server.affinity`; ``None``: any).
    ``idle_spin_s``: how long the idle engine polls its pipes before it sleeps
    (:class:`~piecegraph.server.engine_child.PipeInbox`)."""

    def __init__(self, factory: Callable[[], Any] | None, *, max_pending: int | None = None, metrics: Any = None,
                 frontends: int = 1, engine_cpus: frozenset[int] | None = None, idle_spin_s: float = 0.0) -> None:
        if frontends < 1:
            raise ValueError(f"frontends={frontends!r} must be >= 1")
        self.max_pending, self.metrics, self.index = max_pending or 0, metrics, 0
        self.peer_channels: list[tuple[Any, Any]] = []
        self._proc = None
        if factory is not None:
            ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked; spawn also starts the child clean
            ours, theirs = [], []
            for _ in range(frontends):
                cmd_recv, cmd_send = ctx.Pipe(duplex=False)
                ev_recv, ev_send = ctx.Pipe(duplex=False)
                widen(cmd_send)
                widen(ev_send)
                ours.append((cmd_send, ev_recv))
                theirs.append((cmd_recv, ev_send))
            (self._cmd_send, self._ev_recv), self.peer_channels = ours[0], ours[1:]
            self._child_ends = theirs
            self._proc = ctx.Process(target=engine_main, name="piecegraph-engine", daemon=True,
                                     args=(factory, theirs, torch.get_num_threads(), engine_cpus, idle_spin_s))
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

    @classmethod
    def attach(cls, channel: tuple[Any, Any], info: dict[str, Any], index: int, *, max_pending: int | None = None,
               metrics: Any = None) -> "ProcessEngineLoop":
        """Front end ``index`` (>= 1) in its own process, on ``channel`` (one of front end 0's
        :attr:`peer_channels`) to the running engine process whose ready ``info`` front end 0 got. Its request
        ids carry the index, so they are unique across front ends."""
        loop = cls(None, max_pending=max_pending, metrics=metrics)
        loop.index, (loop._cmd_send, loop._ev_recv) = index, channel
        loop._ready(info)
        return loop

    def start(self) -> None:
        """Start the child and wait until its engine is ready; raises ``RuntimeError`` with the child's error."""
        self._proc.start()
        for cmd_recv, ev_send in self._child_ends:  # the child holds its own copies now
            cmd_recv.close()
            ev_send.close()
        try:
            kind, payload = self._ev_recv.recv()
        except EOFError:
            raise RuntimeError(f"the engine process exited (code {self._proc.exitcode}) before it was ready") from None
        if kind != "ready":
            raise RuntimeError(f"the engine process failed to start:\n{payload}")
        for _, ev_recv in self.peer_channels:  # the other front ends' ready messages carry the same info
            ev_recv.recv()
        self._ready(payload)

    def _ready(self, info: dict[str, Any]) -> None:
        self._cmd = _CommandWriter(self._cmd_send)
        self.info = info
        self.max_pending = self.max_pending or 4 * info["max_num_seqs"]
        self._snapshot = {"used": 0, "total": info["num_pages"] - 1}

    @property
    def alive(self) -> bool:
        child = self._proc is None or self._proc.is_alive()  # an attached front end learns of it by EOF
        return not self._eof and not self._closed.is_set() and child

    def submit(self, prompt: list[int], params: SamplingParams, *, prefix: str = "req") -> Ticket:
        """As :meth:`EngineLoop.submit <piecegraph.server.loop.EngineLoop.submit>`."""
        if self._closing or not self.alive:
            raise Closed("the server is shutting down" if self._closing else "the engine process is not running")
        aloop = asyncio.get_running_loop()
        self.bind(aloop)
        tag = f"{self.index}x" if self.index else ""  # unique across front ends
        ticket = Ticket(f"{prefix}-{tag}{next(self._ids)}", prompt, params, asyncio.Queue(), aloop)
        with self._lock:
            if self._pending >= self.max_pending:
                raise QueueFull(f"{self._pending} requests are in flight, the most this server admits")
            self._pending += 1
            self._tickets[ticket.id] = ticket
        self._cmd.send(("add", ticket.id, prompt, params), aloop)
        return ticket

    def bind(self, aloop: asyncio.AbstractEventLoop) -> None:
        """Read the event pipe on ``aloop`` from now on (once; later calls do nothing). The app's start calls it:
        the engine process tells every front end when KV pages change, so a front end that has not served a
        request yet must read too, or its pipe fills and the engine process blocks sending to it."""
        if self._aloop is None:
            self._aloop = aloop
            aloop.add_reader(self._ev_recv.fileno(), self._on_readable)

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
        if self._proc is not None:
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
        if message[0] == "tokens":  # a step's tokens, every front end's (EventRouter.step)
            _, ids, tokens, done, self._snapshot, counters, counted_by, *cached = message
            tickets = self._tickets
            for rid, n in (cached[0].items() if cached else ()):  # before the first token's event is queued
                ticket = tickets.get(rid)
                if ticket is not None:
                    ticket.cached_tokens = n
            self._dispatch([(rid, [token], done.get(rid), None, False)
                            for rid, token in zip(ids, tokens) if rid in tickets])
            if self.metrics is not None and counted_by == self.index:
                for name, labels, value in counters:
                    self.metrics.inc(name, value, **dict(labels))
        elif message[0] == "events":
            _, events, snapshot, counters = message
            self._snapshot = snapshot
            self._dispatch(events)
            if self.metrics is not None:
                for name, labels, value in counters:
                    self.metrics.inc(name, value, **dict(labels))
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


PIPE_BYTES = 1 << 20  # Linux's default ceiling for an unprivileged process (/proc/sys/fs/pipe-max-size)


def widen(conn: Any, size: int = PIPE_BYTES) -> int:
    """Give ``conn``'s pipe ``size`` bytes of kernel buffer (Linux; elsewhere, or where refused, it keeps its
    64 KiB) and return the size it has. Why: the engine process writes each step's events with a blocking send,
    so a front end a few steps behind in reading (busy streaming at concurrency 1024: ~10 KB of events per step)
    stalls the engine loop once 64 KiB are unread. 1 MiB holds ~100 such steps."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        return 0
    set_size, get_size = getattr(fcntl, "F_SETPIPE_SZ", None), getattr(fcntl, "F_GETPIPE_SZ", None)
    if set_size is None:
        return 0
    try:
        return fcntl.fcntl(conn.fileno(), set_size, size)
    except OSError:  # over this machine's pipe-max-size: keep what it has
        return fcntl.fcntl(conn.fileno(), get_size)


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
