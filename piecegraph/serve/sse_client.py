"""A minimal HTTP/1.1 client for the benchmark: one keep-alive connection per closed-loop client, a JSON POST,
the response's server-sent-event lines as they arrive.

Why not httpx: its connection pool scans every connection for every request, so at hundreds of streams the
client, not the server, is what a benchmark measures. This one does only what the benchmark needs (plain
``http://``, ``Content-Length`` or chunked bodies) and nothing per request beyond parsing.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator
from urllib.parse import urlsplit


class HTTPError(RuntimeError):
    """A response other than 200: its status and the start of its body."""


class Connection:
    """``async with Connection(url) as conn:`` then ``async for line in conn.post_stream(path, body)``; reconnects
    when the server closed the connection. ``url``: ``http://host:port`` (TLS is not supported)."""

    def __init__(self, url: str, timeout_s: float = 600.0) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(f"{url!r}: only http:// URLs are supported by the benchmark client")
        self.host, self.port, self.prefix = parts.hostname or "127.0.0.1", parts.port or 80, parts.path.rstrip("/")
        self.timeout_s = timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> "Connection":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._reader = self._writer = None

    async def post_stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        """POST ``body`` as JSON; yields each non-empty line of the response body as it arrives."""
        data = json.dumps(body).encode()
        request = (f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: "
                   f"application/json\r\nAccept: text/event-stream\r\nContent-Length: {len(data)}\r\n\r\n").encode()
        for attempt in (0, 1):  # a kept-alive connection the server has since closed: reconnect once
            reused = self._writer is not None
            if not reused:
                self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
            reader = self._reader
            try:
                self._writer.write(request + data)
                status, headers = await asyncio.wait_for(_head(reader), self.timeout_s)
                break
            except (ConnectionError, asyncio.IncompleteReadError):
                await self.close()
                if not reused or attempt:
                    raise
        if status != 200:
            text = await _body(reader, headers)
            await self.close()
            raise HTTPError(f"HTTP {status}: {text[:300].decode(errors='replace')}")
        buffer = b""
        async for piece in _pieces(reader, headers):
            buffer += piece
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line.strip():
                    yield line.rstrip(b"\r")
        if buffer.strip():
            yield buffer
        if headers.get("connection", "").lower() == "close":
            await self.close()


async def _head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("the server closed the connection")
    status = int(status_line.split()[1])
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            return status, headers
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()


async def _pieces(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                await reader.readline()  # the empty trailer
                return
            chunk = await reader.readexactly(size + 2)
            yield chunk[:-2]
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:  # the body runs to the end of the connection
        while piece := await reader.read(65536):
            yield piece


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    return b"".join([piece async for piece in _pieces(reader, headers)])
