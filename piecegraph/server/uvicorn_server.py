"""uvicorn for the server: its settings and a ``uvicorn.Server`` that drains the engine loop at shutdown (shared by
the CLI, :class:`~piecegraph.server.run.BackgroundServer` and the extra front-end processes)."""

from __future__ import annotations

from typing import Any, Callable


def uvicorn_config(app: Any, *, host: str, port: int, drain_s: float, log_level: str = "info") -> Any:
    """uvicorn settings for the server: graceful shutdown lets in-flight streams finish for ``drain_s``."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_s,
                          access_log=False)


def draining_server(state: Any, config: Any, on_started: Callable[[], Any] | None = None,
                    on_shutdown: Callable[[], Any] | None = None) -> Any:
    """A ``uvicorn.Server`` that tells the engine loop when shutdown starts (new requests get 503, requests that
    finish while connections drain are logged), before uvicorn waits for the open connections. ``on_started``
    runs once it listens, ``on_shutdown`` when its shutdown starts (front end 0 signals the other front ends)."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if on_started is not None and not self.should_exit:
                on_started()

        async def shutdown(self, sockets: Any = None) -> None:
            if on_shutdown is not None:
                on_shutdown()
            state.loop.begin_close()
            await super().shutdown(sockets)

    return _Server(config)
