"""The decode leg's HTTP client: aiohttp, whose C parser reads D's streamed answer for a
fraction of httpx's per-chunk cost (httpx + httpcore + h11 + anyio were about half the
router's CPU per streamed chunk).

Its answers look like the `httpx.Response` the rest of the router knows (`status_code`,
`headers`, `aiter_bytes`, `aread`, `aclose`) and its failures are raised as the httpx
exceptions `errors.from_transport` maps, so a refused connection still means "never sent"
(another D may take the leg) and a dropped one "broke". Timeouts count from when the
router could act: `connect` bounds the TCP connect only, never a wait for a free pooled
connection (admission, router/api/admission.py, bounds how many legs are open), and `read`
each wait for bytes.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Mapping
from contextvars import ContextVar
from typing import Any

import aiohttp
import httpx
import yarl
from aiohttp.client_proto import ResponseHandler

from . import bodies
from .connect_deadline import ConnectDeadline


def _as_httpx(exc: BaseException) -> httpx.HTTPError:
    """The httpx exception `errors.from_transport` maps like this aiohttp failure."""
    msg = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(msg)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(msg)
    if isinstance(exc, (TimeoutError, aiohttp.ServerTimeoutError)):
        return httpx.ReadTimeout(msg)
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return httpx.RemoteProtocolError(msg)
    return httpx.ReadError(msg)


def _buffered(content: aiohttp.StreamReader) -> bytes:
    """Bytes D sent before its connection broke that aiohttp has not handed out yet: its
    `readany` raises a broken body's error before returning them (it checks the error
    first), yet they are D's tokens, the client's stream and migration's count need them.
    aiohttp has no public call for them (its buffer, as of 3.14)."""
    buf = getattr(content, "_buffer", None)
    if not buf:
        return b""
    data = b"".join(buf)[getattr(content, "_buffer_offset", 0):]
    buf.clear()
    content._buffer_offset = 0  # type: ignore[attr-defined]
    return data


@functools.lru_cache(maxsize=256)
def _url(url: str) -> yarl.URL:
    """An engine URL, parsed once (aiohttp parses a str on every request)."""
    return yarl.URL(url)


@functools.lru_cache(maxsize=64)
def _read_timeout(read_s: float | None) -> aiohttp.ClientTimeout:
    """aiohttp's timeout bounding each wait for bytes only (connects: `ConnectDeadline`)."""
    return aiohttp.ClientTimeout(total=None, connect=None, sock_connect=None, sock_read=read_s)


_DEADLINE: ContextVar[ConnectDeadline | None] = ContextVar("kvferry_connect_deadline",
                                                          default=None)
"""The `ConnectDeadline` of the request the current task is sending (`StreamClient.post`)."""


class _Handler(ResponseHandler):
    """aiohttp's connection protocol, handing a taken answer's HTTP chunk to its taker
    straight from the socket when one read holds exactly one whole chunk (vLLM writes an
    event per chunk): no parser, reader or chunk bookkeeping on the token path. Anything
    else (part of a chunk, several, the last, an extension) goes through aiohttp's parser,
    and so does every read while that parser is not between two chunks.

    `boundary` says it is: `_TakingReader` clears it when the parser starts a chunk and
    sets it when it ends one, and a read that does not end in CRLF clears it (a size line
    cut short fires no hook, and only a whole one ends in CRLF)."""

    boundary = False

    def data_received(self, data: bytes) -> None:
        if self.boundary and (resp := _TAKERS.get(self._payload)) is not None \
                and resp.frame(data):
            return
        self.boundary = False
        super().data_received(data)
        if self.boundary and not data.endswith(b"\r\n"):
            self.boundary = False


_HEX = b"0123456789abcdefABCDEF"


class _Connector(aiohttp.TCPConnector):
    """aiohttp's connector, making `_Handler` connections and telling the request's
    `ConnectDeadline` that it has its connection (made, or taken from the pool). aiohttp's
    trace hooks could tell it too, but a session with a trace config sends every request's
    ~8 trace signals (an object and an await each) to learn this one."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if getattr(self, "_factory", None) is not None:  # aiohttp 3.14's protocol factory
            self._factory = functools.partial(_Handler, loop=self._loop)

    async def connect(self, req: Any, traces: Any, timeout: Any) -> Any:
        conn = await super().connect(req, traces, timeout)
        if (deadline := _DEADLINE.get()) is not None:
            deadline.set()
        return conn


class _TakingReader(aiohttp.StreamReader):
    """aiohttp's body reader that offers each chunk to its taker (`StreamResponse.take`)
    before buffering it for `readany`. The parser calls `feed_data` for every decoded
    chunk; a chunk is offered only while nothing is buffered, so the order holds.
    Installed by class assignment: aiohttp makes its reader itself, and this subclass
    adds no slot."""

    __slots__ = ()

    def feed_data(self, data: bytes, size: int = 0) -> bool:
        resp = _TAKERS.get(self)
        if resp is not None and data and not self._buffer and resp.taker(data):
            self.total_bytes += len(data)
            self._cursor += len(data)  # read, as far as aiohttp's chunk bookkeeping goes
            return False
        return super().feed_data(data, size)

    def end_http_chunk_receiving(self) -> None:
        """aiohttp records where each HTTP chunk ends until a read passes it (`_cursor`),
        stops reading the connection while more than `_high_water_chunks` (16,384 with
        its 256 KiB read buffer) are recorded, and wakes the reader at every chunk's end.
        With nothing buffered every recorded end was taken or read: they are forgotten
        (taken chunks are never read: a stream stalled after its 16,384th token), and
        there is nothing to wake the reader for (it woke, found nothing and slept again:
        a task switch per taken chunk)."""
        if self._buffer:
            super().end_http_chunk_receiving()
        elif self._http_chunk_splits:
            self._http_chunk_splits.clear()
        self._protocol.boundary = True

    def begin_http_chunk_receiving(self) -> None:
        self._protocol.boundary = False
        super().begin_http_chunk_receiving()


_READER_STATE = ("_buffer", "_cursor", "_http_chunk_splits")
"""The reader state `_TakingReader` keeps right (aiohttp 3.14's; a reader without it gets no
taker)."""

_TAKERS: dict[aiohttp.StreamReader | None, StreamResponse] = {}
"""Each taking reader's answer (its `taker`), until it is read to the end or closed."""


def _never(data: bytes) -> bool:
    return False


class Interrupt(Exception):  # noqa: N818 - a signal, not an error
    """Raised by `aiter_bytes` once the taker asked to stop reading (`StreamResponse.stop`)."""


class StreamResponse:
    """D's answer, opened: the status and headers are in, the body is read on demand."""

    def __init__(self, resp: aiohttp.ClientResponse, watch: Watchdog | None = None) -> None:
        self._resp = resp
        self.status_code = resp.status
        self.headers: Mapping[str, str] = resp.headers
        self._done = False
        self._watch = watch
        self.limit: float | None = None
        self.seen = -1  # body bytes when the watchdog last saw them grow
        self.since = 0.0  # loop time it saw that
        self.timed_out = False
        self.taker: Callable[[bytes], bool] = _never
        self.frames = 0
        """Chunks the taker took straight from the socket (`_Handler`)."""

    def frame(self, data: bytes) -> bool:
        """`data` is one whole HTTP chunk (size line, body, CRLF) and the taker took its
        body; else False, and `data` goes through aiohttp's parser."""
        i = data.find(b"\r\n", 0, 10)
        if i <= 0 or data[:i].strip(_HEX) or data[-2:] != b"\r\n":
            return False
        n = int(data[:i], 16)
        content = self._resp.content
        if n == 0 or len(data) != i + n + 4 or content._buffer or not self.taker(
                data[i + 2:-2]):
            return False
        content.total_bytes += n  # the watchdog's measure of progress
        self.frames += 1
        return True

    def take(self, taker: Callable[[bytes], bool]) -> bool:
        """Offer each chunk to `taker` as it arrives, in the connection's callback: it
        returns True when it handled the chunk, else the chunk is buffered for
        `aiter_bytes` (as is every later one until that buffer is read). False: this
        answer cannot (aiohttp's reader is not the one this was written for)."""
        content = self._resp.content
        if type(content) is not aiohttp.StreamReader or not all(
                hasattr(content, a) for a in _READER_STATE):
            return False
        try:
            content.__class__ = _TakingReader
        except TypeError:  # another aiohttp whose reader's layout differs: no taker
            return False
        self.taker = taker
        proto = self._resp.connection.protocol if self._resp.connection else None
        if isinstance(proto, _Handler):
            proto.boundary = False  # until aiohttp's parser ends a chunk
        _TAKERS[content] = self
        return True

    def untake(self) -> None:
        """Stop offering chunks: from now on `aiter_bytes` returns each one."""
        _TAKERS.pop(self._resp.content, None)

    def stop(self, why: BaseException | None = None) -> None:
        """From the taker: stop offering chunks, and make `aiter_bytes` raise `Interrupt`
        (from `why`) instead of returning more."""
        content = self._resp.content
        _TAKERS.pop(content, None)
        exc = Interrupt()
        exc.__cause__ = why
        content.set_exception(exc)

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (chunked framing removed), but those a taker
        handled (`take`).

        The read timeout is the watchdog's (`Watchdog`): aiohttp's own re-arms a loop
        timer on every chunk, a measurable share of the token path's CPU; the watchdog
        reads the reader's byte count instead."""
        content = self._resp.content
        proto = self._resp.connection.protocol if self._resp.connection else None
        watch = self._watch
        if watch is not None and proto is not None and proto.read_timeout:
            self.limit, proto.read_timeout = proto.read_timeout, None
            watch.add(self)
        try:
            while chunk := await content.readany():
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as exc:
            if rest := _buffered(content):
                yield rest
            if self.timed_out:
                raise httpx.ReadTimeout(f"no bytes for {self.limit:g} s") from exc
            raise _as_httpx(exc) from exc
        finally:
            _TAKERS.pop(content, None)
            if watch is not None:
                watch.discard(self)
        self._done = True

    def idle_for(self, now: float) -> float:
        """Seconds since the body last grew, as far as the watchdog's looks tell (its first
        look starts the count)."""
        got = self._resp.content.total_bytes
        if got != self.seen:
            self.seen, self.since = got, now
        return now - self.since

    def expire(self) -> None:
        """The watchdog's verdict: no bytes for `limit` seconds."""
        self.timed_out = True
        self._resp.close()

    async def aread(self) -> bytes:
        try:
            data = await self._resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _as_httpx(exc) from exc
        self._done = True
        return data

    async def aclose(self) -> None:
        """Back to the pool when read to its end, else the connection is dropped (the
        engine then stops generating for it)."""
        _TAKERS.pop(self._resp.content, None)
        if self._done:
            self._resp.release()
        else:
            self._resp.close()


class Watchdog:
    """Read timeouts of open streams, checked a few times per timeout instead of a loop
    timer re-armed on every chunk; a stream whose body did not grow for its limit is
    closed (ReadTimeout). It looks every quarter limit and dates growth by its looks, so a
    stalled stream ends between 1x and 1.5x its limit after its last bytes."""

    def __init__(self) -> None:
        self._streams: set[StreamResponse] = set()
        self._task: asyncio.Task[None] | None = None
        self._period = WATCH_MAX_S

    def add(self, s: StreamResponse) -> None:
        self._streams.add(s)
        s.idle_for(asyncio.get_running_loop().time())  # the count starts now
        assert s.limit is not None
        self._period = min(self._period, max(0.01, s.limit / 4))
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
"""Sent on every leg (a request that names its agent skips aiohttp's slow path for
`skip_auto_headers`: a header copy and a sort per request)."""


class StreamClient:
    """One aiohttp session per router app (made inside its event loop)."""

    def __init__(self, max_connections: int, keepalive_s: float) -> None:
        connector = _Connector(limit=max_connections, limit_per_host=0,
                               keepalive_timeout=keepalive_s, enable_cleanup_closed=False)
        # trust_env=False: proxy variables must never divert engine traffic.
        self.session = aiohttp.ClientSession(connector=connector, trust_env=False)
        self.watchdog = Watchdog()

    async def post(self, url: str, content: bytes, headers: Mapping[str, str],
                   timeout: httpx.Timeout) -> StreamResponse:
        """Send the request; returns once the status line and headers are in.

        The connect timeout is this client's own, not aiohttp's: a loop that was busy
        (or a process that got no CPU) past the deadline runs its expired timers before
        it polls the socket that connected long ago, so aiohttp's timer would fail a leg
        whose engine answered at once. Here a timeout is declared only after the loop
        has polled I/O past the deadline (`ConnectDeadline`)."""
        t = _read_timeout(timeout.read)
        deadline = ConnectDeadline(timeout.connect) if timeout.connect is not None else None
        armed = _DEADLINE.set(deadline)
        try:
            resp = await self.session.post(
                _url(url), data=content, headers={**headers, "User-Agent": USER_AGENT}, timeout=t,
                allow_redirects=False)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if deadline is not None and deadline.fired and task is not None \
                    and task.uncancel() == 0:  # only the deadline cancelled it
                raise _as_httpx(aiohttp.ConnectionTimeoutError(
                    f"no connection within {timeout.connect:g} s")) from None
            raise
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _as_httpx(exc) from exc
        finally:
            _DEADLINE.reset(armed)
            if deadline is not None:
                deadline.stop()
        if deadline is not None and deadline.fired and (task := asyncio.current_task()):
            task.uncancel()  # aiohttp finished all the same: no cancel may stay pending
        return StreamResponse(resp, self.watchdog)

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
        await self.session.close()


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
