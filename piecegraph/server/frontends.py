"""Several HTTP front-end processes on one engine process (``piecegraph serve --api-servers N``).

One front end (uvicorn + FastAPI: parsing, detokenizing, SSE framing, socket writes) spends ~20-35 us of one core
per streamed token, so one process tops out near 30-45k tokens/s: below what the engine makes on an H200 at high
concurrency. Like vLLM's API-server scale-out, front end 0 (the process that started the engine) spawns the
others; each has its own pipe pair to the engine process (:mod:`piecegraph.server.engine_child` routes each
request's events back to the front end that sent it) and its own listening socket on the same port with
``SO_REUSEPORT``, so the kernel spreads new connections evenly over the processes (a shared socket would let
whichever process wakes first take a whole burst). Linux only for N > 1.

Each front end admits ``max_pending / N`` requests (rounded up). ``/metrics`` in any of them adds the others'
latest snapshots, which each writes to a private folder every second (:class:`SharedMetrics`): counters seen
there can lag by up to that second.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("piecegraph.server")


def listening_socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` (not listening yet: uvicorn calls ``listen``); ``reuse_port`` lets
    other front-end processes bind the same port. The connections it accepts send small writes at once (no
    Nagle). Raises ``OSError`` naming the address when it is taken."""
    if reuse_port and not hasattr(socket, "SO_REUSEPORT"):
        raise OSError("several API server processes need SO_REUSEPORT (Linux); use --api-servers 1 here")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not the default 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto says TCP,
    # and accepted sockets inherit it. With proto 0 a keep-alive connection's next response waited for the
    # client's delayed ACK: its first token ~40 ms late on loopback.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"cannot listen on {host}:{port}: {err.strerror}") from None
    return sock


class SharedMetrics:
    """Front end ``index``'s :class:`~piecegraph.server.metrics.Metrics` snapshot written to ``folder`` every
    ``period_s`` seconds (write then rename: a reader never sees half a file); :meth:`peers` reads the others'."""

    def __init__(self, folder: str, index: int, metrics: Any, period_s: float = 1.0) -> None:
        self.folder, self.index, self.metrics, self.period_s = Path(folder), index, metrics, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-share", daemon=True)

    def start(self) -> None:
        self.metrics.peers = self.peers
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._write()

    def peers(self) -> list[dict]:
        out = []
        for path in sorted(self.folder.glob("frontend-*.json")):
            if path.name == f"frontend-{self.index}.json":
                continue
            try:
                out.append(json.loads(path.read_text()))
            except (OSError, ValueError):  # a front end that is gone or never wrote: nothing to add
                continue
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._write()

    def _write(self) -> None:
        tmp = self.folder / f".frontend-{self.index}.tmp"
        try:
            tmp.write_text(json.dumps(self.metrics.snapshot()))
            os.replace(tmp, self.folder / f"frontend-{self.index}.json")
        except OSError:  # the folder went away at shutdown
            pass


@dataclass(frozen=True)
class FrontEndSpec:
    """What every front-end process serves with (pickled into each): the tokenizer itself, the served name, the
    per-process admission limit, the drain seconds, the address and the uvicorn log level."""

    tokenizer: Any
    model_name: str
    max_pending: int
    drain_s: float
    host: str
    port: int
    log_level: str
    metrics_dir: str


class FrontEnds:
    """Front ends 1..N-1 of ``state`` (front end 0's :class:`~piecegraph.server.app.ServerState`, whose loop is a
    started :class:`~piecegraph.server.remote.ProcessEngineLoop` with ``frontends=N``), serving ``host:port``
    beside front end 0's own ``SO_REUSEPORT`` socket. :meth:`start` returns once each listens; :meth:`signal`
    asks them to shut down, :meth:`stop` also waits."""

    def __init__(self, state: Any, host: str, port: int, *, log_level: str = "warning") -> None:
        loop, n = state.loop, len(state.loop.peer_channels) + 1
        self.metrics_dir = tempfile.mkdtemp(prefix="piecegraph-metrics-")
        per_process = -(-loop.max_pending // n)
        loop.max_pending = per_process
        self.spec = FrontEndSpec(state.tokenizer, state.model_name, per_process, state.drain_s, host, port,
                                 log_level, self.metrics_dir)
        self.state, self.processes = state, []
        self._signalled: set[int] = set()
        self.shared = SharedMetrics(self.metrics_dir, 0, state.metrics)

    def start(self, timeout_s: float = 120.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        loop, ready = self.state.loop, []
        for k, channel in enumerate(loop.peer_channels, start=1):
            up_recv, up_send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=frontend_main, args=(k, channel, loop.info, self.spec, up_send),
                               name=f"piecegraph-api-{k}", daemon=True)
            proc.start()
            up_send.close()
            self.processes.append(proc)
            ready.append(up_recv)
        for cmd_send, ev_recv in loop.peer_channels:  # theirs now: a front end that dies gives the engine its EOF
            cmd_send.close()
            ev_recv.close()
        loop.peer_channels = []
        self.shared.start()
        deadline = time.monotonic() + timeout_s
        for k, (proc, up) in enumerate(zip(self.processes, ready), start=1):
            if not up.poll(max(0.0, deadline - time.monotonic())):
                self.stop()
                raise RuntimeError(f"API server {k} did not start within {timeout_s:g} s (exit code {proc.exitcode})")
            try:
                up.recv()
            except EOFError:
                self.stop()
                raise RuntimeError(f"API server {k} exited before it listened (exit code {proc.exitcode})") from None

    def signal(self) -> None:
        """Ask every front end still running to shut down gracefully (SIGTERM: uvicorn drains as on Ctrl-C);
        returns at once. Front end 0 calls it when its own shutdown starts: the engine process stops once every
        front end asked."""
        for proc in self.processes:
            if proc.is_alive() and proc.pid not in self._signalled:
                self._signalled.add(proc.pid)
                os.kill(proc.pid, signal.SIGTERM)

    def stop(self) -> None:
        """:meth:`signal`, then wait for each (drain seconds + 30) and remove the metrics folder."""
        self.signal()
        for proc in self.processes:
            proc.join(timeout=self.spec.drain_s + 30)
            if proc.is_alive():
                log.warning("%s did not stop; terminating it", proc.name)
                proc.terminate()
        self.shared.stop()
        for path in Path(self.metrics_dir).glob("*"):
            path.unlink(missing_ok=True)
        Path(self.metrics_dir).rmdir()


def frontend_main(index: int, channel: tuple[Any, Any], info: dict[str, Any], spec: FrontEndSpec, up: Any) -> None:
    """One extra front-end process: attach to the engine process, bind the shared port, serve until SIGTERM or
    Ctrl-C; says so on ``up`` once it listens."""
    from piecegraph.server.app import ServerState, create_app
    from piecegraph.server.metrics import Metrics
    from piecegraph.server.remote import ProcessEngineLoop
    from piecegraph.server.uvicorn_server import draining_server, uvicorn_config

    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s api-{index}: %(message)s")
    logging.getLogger("piecegraph.server").setLevel(spec.log_level.upper())
    metrics = Metrics()
    loop = ProcessEngineLoop.attach(channel, info, index, max_pending=spec.max_pending, metrics=metrics)
    metrics.gauges = loop.load
    shared = SharedMetrics(spec.metrics_dir, index, metrics)
    shared.start()
    state = ServerState(loop=loop, tokenizer=spec.tokenizer, model_name=spec.model_name,
                        max_seq_len=info["max_seq_len"], vocab_size=info["vocab_size"], metrics=metrics,
                        drain_s=spec.drain_s)
    sock = listening_socket(spec.host, spec.port, reuse_port=True)
    config = uvicorn_config(create_app(state), host=spec.host, port=spec.port, drain_s=spec.drain_s,
                            log_level=spec.log_level)
    server = draining_server(state, config, on_started=lambda: (up.send("up"), up.close()))
    try:
        server.run(sockets=[sock])
    finally:
        shared.stop()
        sock.close()
