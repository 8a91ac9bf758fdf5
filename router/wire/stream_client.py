"""The P and D legs' HTTP/1.1 client: engine connections (router/wire/engine_conn.py, an
asyncio protocol each, parsed by httptools) pooled per engine with keep-alive, and the
requests sent on them.

A leg is one POST to an engine the router knows, answered by JSON (P) or a chunked SSE
stream (D). General clients cost more than that needs: httpx (+ httpcore, h11, anyio)
was about half the router's CPU per streamed chunk, and aiohttp, which replaced it, still
spent about a third of the router's CPU per request on its request and response objects,
payload registry, timers and reader bookkeeping, and a layer of Python per chunk.

Its answers look like the `httpx.Response` the rest of the router knows (`status_code`,
`headers`, `aiter_bytes`, `aread`, `aclose`) and its failures are raised as the httpx
exceptions `errors.from_transport` maps, so a refused connection still means "never sent"
(another D may take the leg) and a dropped one "broke". Timeouts count from when the
router could act: `connect` bounds the TCP connect only (`ConnectDeadline`), never a wait
for a free connection (there is none: admission, router/api/admission.py, bounds how many
legs are open), and `read` each wait for bytes.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx

from . import bodies
from .connect_deadline import ConnectDeadline
from .engine_conn import EngineConn, StreamResponse
from .watchdog import Watchdog

USER_AGENT = "kvferry-router"


@functools.lru_cache(maxsize=256)
def _target(url: str) -> tuple[str, int, bool, str, bytes]:
    """(host, port, tls, path, Host header) of an engine URL, parsed once."""
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise httpx.UnsupportedProtocol(f"not an http(s) URL: {url!r}")
    tls = u.scheme == "https"
    port = u.port or (443 if tls else 80)
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    return u.hostname, port, tls, path, u.netloc.encode("idna")


@functools.lru_cache(maxsize=1)
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


def _head(path: str, host: bytes, headers: Mapping[str, str], length: int) -> bytes:
    lines = [b"POST %s HTTP/1.1\r\nHost: %s\r\nUser-Agent: %s\r\nContent-Length: %d\r\n"
             % (path.encode(), host, USER_AGENT.encode(), length)]
    for k, v in headers.items():
        line = f"{k}: {v}\r\n"
        if "\r" in line[:-2] or "\n" in line[:-2] or "\0" in line:
            raise httpx.LocalProtocolError(f"header {k!r}: line breaks or NUL in it")
        lines.append(line.encode("latin-1"))
    lines.append(b"\r\n")
    return b"".join(lines)



class StreamClient:
    """The legs' connections, pooled per engine (one client per router app, made inside
    its event loop). At most `max_connections` idle connections are kept per engine, each
    for `keepalive_s` (under the engines' own keep-alive: uvicorn closes after 5 s)."""

    def __init__(self, max_connections: int, keepalive_s: float) -> None:
        self._idle: dict[tuple[str, int, bool], list[EngineConn]] = {}
        self._max_idle = max(1, max_connections)
        self._keepalive_s = keepalive_s
        self.watchdog = Watchdog()

    def put(self, conn: EngineConn) -> None:
        """A connection whose answer was read to its end, for the next request."""
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= self._max_idle:
            conn.close()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        idle.append(conn)

    def _pooled(self, key: tuple[str, int, bool]) -> EngineConn | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = asyncio.get_running_loop().time()
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to be closing
            if not conn.closed and now - conn.idle_since < self._keepalive_s:
                return conn
            conn.close()
        return None

    async def _connect(self, key: tuple[str, int, bool], connect_s: float | None) -> EngineConn:
        """A new connection; the connect timeout counts time the router could act in
        (`ConnectDeadline`): a loop that was busy past the deadline runs its expired timers
        before it polls the socket that connected long ago."""
        host, port, tls = key
        loop = asyncio.get_running_loop()
        deadline = ConnectDeadline(connect_s) if connect_s is not None else None
        try:
            _, conn = await loop.create_connection(
                lambda: EngineConn(key, self), host, port,
                ssl=_tls() if tls else None, server_hostname=host if tls else None)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if deadline is not None and deadline.fired and task is not None \
                    and task.uncancel() == 0:  # only the deadline cancelled it
                raise httpx.ConnectTimeout(f"no connection within {connect_s:g} s") from None
            raise
        except OSError as exc:
            raise httpx.ConnectError(f"{type(exc).__name__}: {exc}") from exc
        finally:
            if deadline is not None:
                deadline.stop()
        if deadline is not None and deadline.fired and (task := asyncio.current_task()):
            task.uncancel()  # connected all the same: no cancel may stay pending
        return conn

    async def post(self, url: str, content: bytes, headers: Mapping[str, str],
                   timeout: httpx.Timeout) -> StreamResponse:
        """Send the request; returns once the status line and headers are in."""
        host, port, tls, path, host_hdr = _target(url)
        key = (host, port, tls)
        req = _head(path, host_hdr, headers, len(content)) + content
        conn = self._pooled(key) or await self._connect(key, timeout.connect)
        resp = StreamResponse(conn, self.watchdog, timeout.read)
        conn.resp, conn.keep = resp, False
        if resp.limit:
            self.watchdog.add(resp)  # the read timeout, from the wait for the head on
        assert conn.transport is not None
        conn.transport.write(req)
        try:
            await resp.head
        except httpx.HTTPError:
            self.watchdog.discard(resp)
            if resp.timed_out:
                raise httpx.ReadTimeout(f"no answer within {timeout.read:g} s") from None
            raise
        except BaseException:
            self.watchdog.discard(resp)
            conn.close()
            raise
        return resp

    async def fetch(self, url: str, content: bytes, headers: Mapping[str, str],
                    timeout: httpx.Timeout) -> Answer:
        """POST and read the whole answer (the prefill leg's JSON)."""
        resp = await self.post(url, content, headers, timeout)
        try:
            return Answer(resp.status_code, resp.headers, await resp.aread())
        finally:
            await resp.aclose()

    async def close(self) -> None:
        self.watchdog.close()
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


class Answer:
    """A whole answer, read: what the router uses of an `httpx.Response`."""

    def __init__(self, status_code: int, headers: Mapping[str, str], content: bytes) -> None:
        self.status_code = status_code
        self.headers = headers
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self) -> Any:
        """The body as JSON (`bodies.decode`: msgspec, a 24k-id answer in a third of the
        stdlib's time); malformed JSON raises ValueError, as httpx's `json()` does."""
        return bodies.decode(self.content)


async def fetch(streams: StreamClient | None, client: httpx.AsyncClient, url: str,
                content: bytes, headers: Mapping[str, str], timeout: httpx.Timeout
                ) -> Answer | httpx.Response:
    """POST and read the whole answer: through `streams` when the app has one (a fraction
    of httpx's CPU per request), else httpx."""
    if streams is not None:
        return await streams.fetch(url, content, headers, timeout)
    return await client.post(url, content=content, headers=dict(headers), timeout=timeout)


async def open_leg(streams: StreamClient | None, client: httpx.AsyncClient, url: str,
                   content: bytes, headers: Mapping[str, str], timeout: httpx.Timeout
                   ) -> StreamResponse | httpx.Response:
    """POST a decode leg and return its opened answer: through `streams` when the app has
    one, else httpx (the same interface either way)."""
    if streams is not None:
        return await streams.post(url, content, headers, timeout)
    req = client.build_request("POST", url, content=content, headers=dict(headers),
                               timeout=timeout)
    return await client.send(req, stream=True)


LegResponse = StreamResponse | httpx.Response
"""An opened decode answer, whichever client opened it."""
