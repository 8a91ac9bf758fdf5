"""One engine connection of the legs' HTTP/1.1 client and the answer it is reading
(router/wire/stream_client.py pools the connections and sends the requests).

The connection is an asyncio protocol parsed by httptools (llhttp, the C parser the
router's server already uses); its answer hands body bytes to a taker as they arrive
(the token path: `sse.UpstreamStream`) or buffers them for `aiter_bytes`. Failures are
the httpx exceptions `errors.from_transport` maps ("broke", for a dropped connection).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import httptools
import httpx

from .watchdog import Watchdog

_HEX = b"0123456789abcdefABCDEF"
HIGH_WATER = 256 * 1024
"""Body bytes buffered for a reader that does not keep up: reading the connection pauses
(the engine's socket fills and it waits), and resumes once they are read."""


class Interrupt(Exception):  # noqa: N818 - a signal, not an error
    """Raised by `aiter_bytes` once the taker asked to stop reading (`StreamResponse.stop`)."""


class Pool(Protocol):
    """Where a connection goes back once its answer was read to the end (`StreamClient`)."""

    def put(self, conn: EngineConn) -> None: ...


class EngineConn(asyncio.Protocol):
    """One keep-alive connection to an engine, one request at a time (`resp`).

    A read that holds exactly one whole HTTP chunk of a taken answer (vLLM writes an event
    per chunk) goes to the taker without the parser (`StreamResponse.frame`); anything
    else (part of a chunk, several, the last, an extension) goes through the parser, and
    so does every read while the parser is not between two chunks. `boundary` says it is:
    the parser's chunk callbacks clear and set it, and a read that does not end in CRLF
    clears it (a size line cut short fires no callback, and only a whole one ends in CRLF).
    """

    def __init__(self, key: tuple[str, int, bool], pool: Pool) -> None:
        self.key = key
        self.pool = pool
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

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # -- httptools ---------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.resp is not None
        self.resp.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        resp = self.resp
        assert resp is not None
        resp.status_code = self.parser.get_status_code()
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

    def __init__(self, conn: EngineConn, watchdog: Watchdog, read_s: float | None) -> None:
        self._conn = conn
        self._watchdog = watchdog
        self._loop = asyncio.get_running_loop()
        self.head: asyncio.Future[None] = self._loop.create_future()
        self.status_code = 0
        self.headers: dict[str, str] = {}
        """Lower-case names (the router looks them up so)."""
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
        """Chunks the taker took straight from the socket (`EngineConn`)."""
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
        error. The read timeout is the watchdog's (`Watchdog`, from `StreamClient.post` on)."""
        watch = self._watchdog
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
        self._watchdog.discard(self)
        conn = self._conn
        if self._done and self._exc is None and conn.keep and not conn.closed:
            conn.resp = None
            conn.pool.put(conn)
        else:
            conn.close()
