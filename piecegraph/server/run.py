"""Putting it together: an engine and a tokenizer -> the app, served by uvicorn in the foreground (the CLI) or on a
background thread (tests, notebooks)."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from piecegraph.serve.engine import Engine
from piecegraph.server.loop import EngineLoop
from piecegraph.server.metrics import Metrics
from piecegraph.server.tokenizer import Tokenizer
from piecegraph.server.uvicorn_server import draining_server, uvicorn_config


def build_state(engine: Engine, tokenizer: Tokenizer, model_name: str, *, max_pending: int | None = None,
                drain_s: float = 30.0) -> Any:
    """The :class:`~piecegraph.server.app.ServerState` for ``engine``: its loop (not started: the app's lifespan
    starts it), metrics reading the loop's gauges. ``max_pending`` (default: four times ``max_num_seqs``) is how
    many requests are admitted at once, running or waiting; more get 429."""
    from piecegraph.server.app import ServerState

    metrics = Metrics()
    loop = EngineLoop(engine, max_pending=max_pending or 4 * engine.config.max_num_seqs, metrics=metrics)
    metrics.gauges = loop.load
    max_len = engine.config.max_seq_len or engine.model.config.max_seq_len
    return ServerState(loop=loop, tokenizer=tokenizer, model_name=model_name, max_seq_len=max_len,
                       vocab_size=engine.model.config.vocab_size, metrics=metrics, drain_s=drain_s)


def build_process_state(factory: Callable[[], Engine], tokenizer_for: Callable[[int], Tokenizer], model_name: str, *,
                        max_pending: int | None = None, drain_s: float = 30.0, frontends: int = 1,
                        engine_cpus: frozenset[int] | None = None, idle_spin_s: float = 0.0) -> Any:
    """As :func:`build_state`, with the engine built by ``factory`` (picklable) in its own process
    (:class:`~piecegraph.server.remote.ProcessEngineLoop`); blocks until it is ready. ``tokenizer_for(vocab_size)``
    gives the tokenizer once the engine says its vocabulary. ``frontends`` > 1: the engine also serves that many
    minus one more front-end processes, which :class:`BackgroundServer` or the CLI start
    (:class:`~piecegraph.server.frontends.FrontEnds`). ``engine_cpus``: the engine process's CPUs (``None``: any);
    ``idle_spin_s``: how long its idle loop polls before it sleeps.
    """
    from piecegraph.server.app import ServerState
    from piecegraph.server.remote import ProcessEngineLoop

    metrics = Metrics()
    loop = ProcessEngineLoop(factory, max_pending=max_pending, metrics=metrics, frontends=frontends,
                             engine_cpus=engine_cpus, idle_spin_s=idle_spin_s)
    loop.start()
    metrics.gauges = loop.load
    info = loop.info
    return ServerState(loop=loop, tokenizer=tokenizer_for(info["vocab_size"]), model_name=model_name,
                       max_seq_len=info["max_seq_len"], vocab_size=info["vocab_size"], metrics=metrics,
                       drain_s=drain_s)


def http_stack() -> tuple[str, str | None]:
    """What uvicorn serves with here (``"uvloop + httptools"`` at best) and, when its C parts are missing, a hint:
    its pure-Python loop and HTTP parser cost several times more per streamed token (a GPU engine's 30-40k
    tokens/s need the C ones)."""
    import importlib.util

    missing = [name for name in ("uvloop", "httptools") if importlib.util.find_spec(name) is None]
    loop = "asyncio" if "uvloop" in missing else "uvloop"
    parser = "h11" if "httptools" in missing else "httptools"
    hint = (f"{' and '.join(missing)} not installed: pip install 'piecegraph[server]' (uvicorn[standard]) for "
            "the fast event loop and HTTP parser") if missing else None
    return f"{loop} + {parser}", hint


class BackgroundServer:
    """Serve ``state`` on ``127.0.0.1`` at a free port on a daemon thread: ``with BackgroundServer(state) as s:``
    then ``s.url`` (``http://127.0.0.1:PORT``). Leaving the block shuts down gracefully (``state.drain_s``).
    A process engine built with ``frontends`` > 1 gets its other front-end processes on the same port."""

    def __init__(self, state: Any, *, log_level: str = "warning") -> None:
        from piecegraph.server.app import create_app
        from piecegraph.server.frontends import listening_socket

        self.state, self.frontends = state, None
        several = bool(getattr(state.loop, "peer_channels", None))
        self._sock = listening_socket("127.0.0.1", 0, reuse_port=several)  # a free port: no race with other tests
        self.port = self._sock.getsockname()[1]
        if several:
            from piecegraph.server.frontends import FrontEnds

            self.frontends = FrontEnds(state, "127.0.0.1", self.port, log_level=log_level)
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(create_app(state), host="127.0.0.1", port=self.port, drain_s=state.drain_s,
                                log_level=log_level)
        self.server = draining_server(state, config, on_shutdown=self.frontends and self.frontends.signal)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True,
                                        name="uvicorn")

    def __enter__(self) -> "BackgroundServer":
        if self.frontends is not None:
            self.frontends.start()
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        self.server.should_exit = True  # its shutdown signals the other front ends (the engine waits for all)
        if self.frontends is not None:
            self.frontends.stop()
        self._thread.join(timeout=self.state.drain_s + 30)
        self._sock.close()
