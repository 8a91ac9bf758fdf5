"""The P and D legs' HTTP/1.1 client: one small asyncio protocol per engine connection,
parsed by httptools (llhttp, the C parser the router's server already uses), pooled per
engine with keep-alive.

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
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import httptools
import httpx

from . import bodies
from .connect_deadline import ConnectDeadline

_HEX = b"0123456789abcdefABCDEF"
HIGH_WATER = 256 * 1024
"""Body bytes buffered for a reader that does not keep up: reading the connection pauses
(the engine's socket fills and it waits), and resumes once they are read."""


class Interrupt(Exception):  # noqa: N818 - a signal, not an error
    """Raised by `aiter_bytes` once the taker asked to stop reading (`StreamResponse.stop`)."""


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


class _Conn(asyncio.Protocol):
    """One keep-alive connection to an engine, one request at a time (`resp`).

    A read that holds exactly one whole HTTP chunk of a taken answer (vLLM writes an event
    per chunk) goes to the taker without the parser (`StreamResponse.frame`); anything
    else (part of a chunk, several, the last, an extension) goes through the parser, and
    so does every read while the parser is not between two chunks. `boundary` says it is:
    the parser's chunk callbacks clear and set it, and a read that does not end in CRLF
    clears it (a size line cut short fires no callback, and only a whole one ends in CRLF).
    """

    def __init__(self, key: tuple[str, int, bool]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: StreamResponse | None = None
        self.closed = False
        self.keep = False  # the last answer ended and allows another request
        self.idle_since = 0.0
        self.boundary = False

    # -- asyncio -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None or resp.ended:  # bytes no request asked for: not HTTP as we know it
            self.close()
            return
        if self.boundary and resp.taker is not None and resp.frame(data):
            return
        self.boundary = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            resp.fail(httpx.RemoteProtocolError(f"malformed HTTP answer: {exc}"))
            self.close()
            return
        if self.boundary and not data.endswith(b"\r\n"):
            self.boundary = False

    def eof_received(self) -> bool:
        return False  # close: a half-closed engine connection is of no further use

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        resp = self.resp
        if resp is None or resp.ended:
            return
        if resp.head.done() and "content-length" not in resp.headers \
                and "transfer-encoding" not in resp.headers:
            resp.end()  # a body delimited by the close (RFC 9112 6.3), ended cleanly
        else:
            resp.fail(httpx.RemoteProtocolError(
                f"engine closed the connection{f': {exc}' if exc else ''}"))

    def pause_writing(self) -> None:  # a request is one write; nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # -- httptools ---------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.resp is not None
        self.resp.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        resp = self.resp
        assert resp is not None
        resp.status_code = self.parser.get_status_code()
        resp.headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                        for k, v in resp.raw_headers}
        if not resp.head.done():
            resp.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        assert self.resp is not None
        self.resp.feed(body)

    def on_chunk_header(self) -> None:
        self.boundary = False

    def on_chunk_complete(self) -> None:
        self.boundary = True

    def on_message_complete(self) -> None:
        self.keep = self.parser.should_keep_alive()
        assert self.resp is not None
        self.resp.end()


class StreamResponse:
    """An engine's answer, opened: the status and headers are in, the body is read on
    demand (`aiter_bytes`, `aread`) or handed to a taker as it arrives (`take`)."""

    def __init__(self, client: StreamClient, conn: _Conn, read_s: float | None) -> None:
        self._client = client
        self._conn = conn
        self._loop = asyncio.get_running_loop()
        self.head: asyncio.Future[None] = self._loop.create_future()
        self.status_code = 0
        self.headers: dict[str, str] = {}
        """Lower-case names (the router looks them up so)."""
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self._buf: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self.ended = False  # the whole answer is in (or it broke: `_exc`)
        self._exc: BaseException | None = None
        self._stop: Interrupt | None = None
        self._done = False  # read to its end by the caller
        self._closed = False
        self.taker: Callable[[bytes], bool] | None = None
        self.total_bytes = 0
        self.frames = 0
        """Chunks the taker took straight from the socket (`_Conn`)."""
        self.limit = read_s
        self.seen = -1  # body bytes when the watchdog last saw them grow
        self.since = 0.0  # loop time it saw that
        self.timed_out = False

    # -- from the connection -----------------------------------------------------------
    def frame(self, data: bytes) -> bool:
        """`data` is one whole HTTP chunk (size line, body, CRLF) and the taker took its
        body; else False, and `data` goes through the parser."""
        i = data.find(b"\r\n", 0, 10)
        if i <= 0 or data[:i].strip(_HEX) or data[-2:] != b"\r\n":
            return False
        n = int(data[:i], 16)
        if n == 0 or len(data) != i + n + 4 or self._buf or not self.taker(  # type: ignore[misc]
                data[i + 2:-2]):
            return False
        self.total_bytes += n
        self.frames += 1
        return True

    def feed(self, body: bytes) -> None:
        self.total_bytes += len(body)
        take = self.taker
        if take is not None and not self._buf and take(body):
            return
        self._buf.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and not self._paused and self._conn.transport:
            self._paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def fail(self, exc: BaseException) -> None:
        if self.ended:
            return
        self.ended = True
        if not self.head.done():
            self.head.set_exception(exc)
            self.head.exception()  # retrieved: a head nobody awaits any more stays quiet
        self._exc = exc
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    # -- the taker ---------------------------------------------------------------------
    def take(self, taker: Callable[[bytes], bool]) -> bool:
        """Offer each body piece to `taker` as it arrives, in the connection's callback:
        it returns True when it handled the piece, else the piece is buffered for
        `aiter_bytes` (as is every later one until that buffer is read)."""
        self.taker = taker
        self._conn.boundary = False  # until the parser ends a chunk
        return True

    def untake(self) -> None:
        """Stop offering pieces: from now on `aiter_bytes` returns each one."""
        self.taker = None

    def stop(self, why: BaseException | None = None) -> None:
        """From the taker: stop offering pieces, and make `aiter_bytes` raise `Interrupt`
        (from `why`) instead of returning more."""
        self.taker = None
        exc = Interrupt()
        exc.__cause__ = why
        self._stop = exc
        self._wake()

    # -- the reader --------------------------------------------------------------------
    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (chunked framing removed), but those a taker
        handled (`take`). Bytes that came before the connection broke come before its
        error. The read timeout is the watchdog's (`Watchdog`, from `StreamClient.post`)."""
        watch = self._client.watchdog
        try:
            while True:
                if self._stop is not None:
                    raise self._stop
                if self._buf:
                    chunk = self._buf.popleft()
                    self._buffered -= len(chunk)
                    if self._paused and self._buffered <= HIGH_WATER // 4:
                        self._paused = False
                        if self._conn.transport is not None:
                            self._conn.transport.resume_reading()
                    yield chunk
                    continue
                if self._exc is not None:
                    if self.timed_out:
                        raise httpx.ReadTimeout(f"no bytes for {self.limit:g} s") from self._exc
                    raise self._exc
                if self.ended:
                    break
                self._waiter = self._loop.create_future()
                await self._waiter
        finally:
            self.taker = None
            watch.discard(self)
        self._done = True

    async def aread(self) -> bytes:
        return b"".join([c async for c in self.aiter_bytes()])

    def idle_for(self, now: float) -> float:
        """Seconds since the answer last grew (its head, then its body), as far as the
        watchdog's looks tell (its first look starts the count)."""
        got = self.total_bytes + (self.status_code > 0)
        if got != self.seen:
            self.seen, self.since = got, now
        return now - self.since

    def expire(self) -> None:
        """The watchdog's verdict: no bytes for `limit` seconds."""
        self.timed_out = True
        self._conn.close()

    async def aclose(self) -> None:
        """Back to the pool when read to its end, else the connection is dropped (the
        engine then stops generating for it)."""
        if self._closed:
            return
        self._closed = True
        self.taker = None
        self._client.watchdog.discard(self)
        conn = self._conn
        if self._done and self._exc is None and conn.keep and not conn.closed:
            conn.resp = None
            self._client.put(conn)
        else:
            conn.close()


class Watchdog:
    """Read timeouts of open streams, checked a few times per timeout instead of a loop
    timer re-armed on every chunk; a stream whose body did not grow for its limit is
    closed (ReadTimeout). It looks every quarter limit and dates growth by its looks (a new
    stream's count starts at its first look), so a stalled stream ends between 1x and 1.5x
    its limit after its last bytes."""

    def __init__(self) -> None:
        self._streams: set[StreamResponse] = set()
        self._task: asyncio.Task[None] | None = None
        self._period = WATCH_MAX_S

    def add(self, s: StreamResponse) -> None:
        """Watch `s` (its count starts at the next look: `StreamResponse.seen` is -1)."""
        self._streams.add(s)
        assert s.limit is not None
        if s.limit < 4 * self._period:
            self._period = max(0.01, s.limit / 4)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def discard(self, s: StreamResponse) -> None:
        self._streams.discard(s)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._streams:
            await asyncio.sleep(self._period)
            now = loop.time()
            for s in [s for s in self._streams if s.limit and s.idle_for(now) > s.limit]:
                self._streams.discard(s)
                s.expire()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


WATCH_MAX_S = 1.0
USER_AGENT = "kvferry-router"


class StreamClient:
    """The legs' connections, pooled per engine (one client per router app, made inside
    its event loop). At most `max_connections` idle connections are kept per engine, each
    for `keepalive_s` (under the engines' own keep-alive: uvicorn closes after 5 s)."""

    def __init__(self, max_connections: int, keepalive_s: float) -> None:
        self._idle: dict[tuple[str, int, bool], list[_Conn]] = {}
        self._max_idle = max(1, max_connections)
        self._keepalive_s = keepalive_s
        self.watchdog = Watchdog()
        self._loop: asyncio.AbstractEventLoop | None = None

    def put(self, conn: _Conn) -> None:
        """A connection whose answer was read to its end, for the next request."""
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= self._max_idle:
            conn.close()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        idle.append(conn)

    def _pooled(self, key: tuple[str, int, bool]) -> _Conn | None:
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

    async def _connect(self, key: tuple[str, int, bool], connect_s: float | None) -> _Conn:
        """A new connection; the connect timeout counts time the router could act in
        (`ConnectDeadline`): a loop that was busy past the deadline runs its expired timers
        before it polls the socket that connected long ago."""
        host, port, tls = key
        loop = asyncio.get_running_loop()
        deadline = ConnectDeadline(connect_s) if connect_s is not None else None
        try:
            _, conn = await loop.create_connection(
                lambda: _Conn(key), host, port,
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
        resp = StreamResponse(self, conn, timeout.read)
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
