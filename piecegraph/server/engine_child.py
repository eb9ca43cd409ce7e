"""The engine process's side of :class:`~piecegraph.server.remote.ProcessEngineLoop`: one engine loop serving one
or more HTTP front-end processes, each over its own pair of pipes (commands in, events out).

The engine thread reads every command pipe itself between steps (``multiprocessing.connection.wait`` over them;
blocking only when idle), remembers which front end submitted each request, and sends each front end only its
own requests' events, one message per front end per step. A front end that dies (its command pipe reaches EOF)
has its requests aborted and their pages freed; the others keep being served.
"""

from __future__ import annotations

import queue
import time
import traceback
from collections import deque
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import torch

from piecegraph.server.loop import Event, Ticket


class CounterBatch:
    """Stands in for metrics in the child: adds up counter increments (steps by kind, loop and phase seconds) until
    the next event batch takes them to the front ends, as ``(name, labels, value)`` rows."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = (name, tuple(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + value

    def take(self) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
        out, self.values = [(name, labels, v) for (name, labels), v in self.values.items()], {}
        return out

    def restore(self, rows: list[tuple[str, tuple[tuple[str, str], ...], float]]) -> None:
        """Put back what :meth:`take` gave, when nobody got it (its front end died)."""
        for name, labels, value in rows:
            self.values[(name, labels)] = self.values.get((name, labels), 0.0) + value


class PipeInbox:
    """The child's :class:`~piecegraph.server.loop.EngineLoop` inbox, read by the engine thread straight from the
    front ends' command pipes (``get`` / ``get_nowait`` as ``queue.SimpleQueue``'s): no thread in between, so a
    command never waits for the GIL. ``owner`` maps each live request id to the index of the front end that sent
    it. Shutdown starts once every live front end asked for it (front ends shut down together: Ctrl-C reaches the
    process group, the launcher signals each); the ``close`` messages set the drain deadline (the earliest):
    ``stop`` once the loop is idle or the deadline passed (once; after it, what is still in the pipes is handed
    over, so requests that raced the close are aborted as in-process). Every front end gone (EOF on every pipe)
    stops at once. ``idle_spin_s``: for this long after the engine was last busy, an idle wait polls the pipes
    instead of sleeping in the kernel, so a request that arrives then starts at once on a core that is still warm
    (a closed-loop client at concurrency 1 sends its next request ~1-2 ms after its last token); then it blocks."""

    def __init__(self, conns: list[Any], idle_spin_s: float = 0.0) -> None:
        self.conns = dict(enumerate(conns))  # index -> command pipe, live front ends only
        self.idle_spin_s, self.busy_at = idle_spin_s, time.monotonic()
        self.owner: dict[str, int] = {}
        self.local: deque = deque()
        self.loop: Any = None  # the EngineLoop reading this inbox (set once it is built)
        self.deadline: float | None = None
        self.stopping = False
        self.closing: dict[int, float | None] = {}  # front end -> its drain deadline (None: begin_close only)

    def put(self, item: tuple) -> None:
        self.local.append(item)

    def get_nowait(self) -> tuple:
        return self.get(0.0)

    def get(self, timeout: float = 0.0) -> tuple:
        if self.local:
            return self.local.popleft()
        now = time.monotonic()
        if self.deadline is not None and not self.stopping:
            if self.loop.stopped or now >= self.deadline:
                self.stopping = True
                return ("stop", None)
            timeout = min(timeout, self.deadline - now)
        if timeout <= 0:  # the engine is busy: it looks between steps
            self.busy_at = now
        ready = self._wait(list(self.conns.values()), now, timeout) if self.conns else []
        if not ready:
            raise queue.Empty
        index_of = {id(conn): k for k, conn in self.conns.items()}
        for conn in ready:
            k = index_of[id(conn)]
            try:
                message = conn.recv()
            except (EOFError, OSError):
                self._lost(k)
                continue
            self._apply(k, message)
        if not self.conns and not self.stopping:  # no front end left: nobody can read what the engine makes
            self.deadline, self.stopping = 0.0, True
            return ("stop", None)
        return self.local.popleft() if self.local else ("wake", None)

    def _wait(self, conns: list[Any], now: float, timeout: float) -> list[Any]:
        """The pipes with a message, waiting up to ``timeout`` seconds (polling while within the spin window)."""
        end = now + timeout
        spin_until = min(self.busy_at + self.idle_spin_s, end)
        while now < spin_until:
            ready = wait(conns, 0)
            if ready:
                return ready
            now = time.monotonic()
        return wait(conns, max(0.0, end - now))

    def _apply(self, k: int, message: tuple) -> None:
        kind = message[0]
        if kind == "add":  # through the loop's own methods, which put their command here
            self.owner[message[1]] = k
            self.loop.enqueue(Ticket(message[1], message[2], message[3]))
        elif kind == "abort":
            self.loop.abort_id(message[1])
        else:  # begin_close, or close (with its drain)
            deadline = time.monotonic() + message[1] if kind == "close" else None
            self.closing[k] = deadline if self.closing.get(k) is None else self.closing[k]
            self._maybe_close()

    def _maybe_close(self) -> None:
        if not self.conns or not all(k in self.closing for k in self.conns):
            return
        self.loop.begin_close()
        deadlines = [self.closing[k] for k in self.conns]
        if all(d is not None for d in deadlines):
            self.deadline = min(deadlines)

    def _lost(self, k: int) -> None:
        """Front end ``k`` is gone: abort its requests (their pages are freed at the loop's next command)."""
        conn = self.conns.pop(k)
        conn.close()
        for rid in [rid for rid, owner in self.owner.items() if owner == k]:
            self.loop.abort_id(rid)
        self._maybe_close()  # the others may all be closing already


class EventRouter:
    """Sends each front end its requests' events: one message per front end per call (also an empty one when the
    KV pages in use changed since it last heard), each carrying the pages in use and (the first one) the counters
    added up since the last message (:class:`CounterBatch`). A front end whose pipe is broken is dropped (the
    inbox sees its EOF and aborts its requests)."""

    def __init__(self, conns: list[Any], owner: dict[str, int], cache: Any, counters: CounterBatch) -> None:
        self.conns, self.owner, self.cache, self.counters = dict(enumerate(conns)), owner, cache, counters
        self.told: dict[int, dict] = {}  # the KV pages snapshot each front end last got

    def send(self, rows: list[tuple]) -> None:
        """``rows``: ``(request id, new ids, finish reason, error, refused)``; a finished row ends the id's route."""
        if len(self.conns) <= 1:  # one front end (or a dying one's last): no routing to do
            parts = {next(iter(self.conns), 0): rows}
        else:
            parts = {}
            owner = self.owner
            for row in rows:
                parts.setdefault(owner.get(row[0], 0), []).append(row)
        for row in rows:
            if row[2] or row[3]:
                self.owner.pop(row[0], None)
        cache = self.cache
        snapshot = {"used": cache.num_pages - 1 - cache.num_free_pages, "total": cache.num_pages - 1}
        # pages freed by another's requests: say so too
        to = [k for k in self.conns if k in parts or self.told.get(k) != snapshot]
        counters = self.counters.take() if to else []  # kept for a later message when nobody hears now
        for k in to:
            self._to(k, ("events", parts.get(k, []), snapshot, counters))
            self.told[k], counters = snapshot, []

    def step(self, requests: list[Any], tokens: list[int], finished: list[Any], cached: dict | None = None) -> None:
        """A step's tokens (``requests[i]`` got ``tokens[i]``; ``finished``: those that finished, with their
        reasons; ``cached``: prompt tokens the prefix cache held, of requests whose first token this is, appended
        to the message only when there are any) as ONE pickle written to every front end; each takes the ids it
        holds and skips the rest. Routing
        per row in this process cost more than every front end reading every row (the engine is host-bound; the
        front ends run beside it). The counters ride along, marked for the lowest live front end to add."""
        ids = [r.id for r in requests]
        done = {r.id: r.finish_reason for r in finished}
        for rid in done:
            self.owner.pop(rid, None)
        cache = self.cache
        snapshot = {"used": cache.num_pages - 1 - cache.num_free_pages, "total": cache.num_pages - 1}
        counters, counted_by = self.counters.take(), min(self.conns, default=-1)
        message = ("tokens", ids, tokens, done, snapshot, counters, counted_by)
        payload = ForkingPickler.dumps((*message, cached) if cached else message)
        for k in list(self.conns):
            self.told[k] = snapshot
            try:
                self.conns[k].send_bytes(payload)
            except OSError:  # that front end died; its requests are aborted when the inbox sees the EOF
                del self.conns[k]
                if k == counted_by:  # the next step's message carries them to the next front end
                    self.counters.restore(counters)

    def broadcast(self, message: tuple) -> None:
        for k in list(self.conns):
            self._to(k, message)

    def _to(self, k: int, message: tuple) -> None:
        conn = self.conns.get(k)
        if conn is None:
            return
        try:
            conn.send(message)
        except OSError:  # that front end died; its requests are aborted when the inbox sees the EOF
            del self.conns[k]


def engine_main(factory: Callable[[], Any], channels: list[tuple[Any, Any]], threads: int,
                cpus: frozenset[int] | None = None, idle_spin_s: float = 0.0) -> None:
    """The engine process: build the engine, then run its loop on this thread until told to close.
    ``channels``: one ``(command pipe, event pipe)`` pair per front end; ``cpus``: the CPUs it runs on (pinned
    before any thread starts, so its threads keep to them too; ``None``: any); ``idle_spin_s``: as
    :class:`PipeInbox`'s."""
    import signal

    from piecegraph.server.affinity import pin
    from piecegraph.server.loop import EngineLoop

    pin(cpus)
    # Ctrl-C reaches the whole process group: the server processes drain and then tell this one to close.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(min(threads, len(cpus)) if cpus else threads)
    commands, events = [c for c, _ in channels], [e for _, e in channels]
    try:
        engine = factory()
    except BaseException:  # noqa: BLE001  (the parent shows the child's error and exits)
        for conn in events:
            conn.send(("failed", traceback.format_exc()))
        return
    counters, inbox = CounterBatch(), PipeInbox(commands, idle_spin_s)
    router = EventRouter(events, inbox.owner, engine.cache, counters)

    def sink(batch: list[tuple[Ticket, Event]]) -> None:
        router.send([(t.id, e.ids, e.finish_reason, e.error, e.refused) for t, e in batch])

    def step_sink(requests: list[Any], tokens: list[int], finished: list[Any], at: float, cached: dict) -> None:
        router.step(requests, tokens, finished, cached)  # the front ends stamp their own time

    loop = inbox.loop = EngineLoop(engine, max_pending=1 << 30, metrics=counters, sink=sink, inbox=inbox,
                                   step_sink=step_sink)  # the front ends admit
    config = engine.config
    router.broadcast(("ready", {"max_seq_len": config.max_seq_len or engine.model.config.max_seq_len,
                                "vocab_size": engine.model.config.vocab_size, "max_num_seqs": config.max_num_seqs,
                                "num_pages": engine.cache.num_pages, "setup_s": engine.setup_s}))
    loop.run()  # on this thread: it reads the command pipes itself (see PipeInbox)
    router.broadcast(("closed", loop.finished_at_close, loop.aborted_at_close))
