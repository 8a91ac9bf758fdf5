"""Pass an upstream SSE stream to the client chunk by chunk.

Written as a raw ASGI response (not StreamingResponse) so that the upstream stream is
closed in every case: normal end, upstream error, and client disconnect (watched on
`receive` for all ASGI servers, not only those that raise on send).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import anyio
import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..errors import RouterError, error_body, from_transport
from .direct_body import DirectBody, direct_body
from .engine_conn import Interrupt, StreamResponse
from .sse_filters import DONE, DONE_EVENT, ChunkFilter
from .stream_client import LegResponse

log = logging.getLogger(__name__)


RAW_SEND = "kvferry.raw_send"
"""Scope key of the server's own ``send`` (`RawSend`)."""


class RawSend:
    """The outermost ASGI app: keeps the server's own ``send`` in the scope, so a streamed
    answer's body chunks skip the framework's send wrappers (Starlette's error and
    exception middlewares each re-await every message only to learn whether the response
    started; the start message still goes through them)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND] = send
        await self.app(scope, receive, send)


def sse_error_event(message: str, status: int, err_type: str) -> bytes:
    """An in-band error event plus [DONE], for failures after headers were sent."""
    payload = json.dumps(error_body(message, status, err_type))
    return f"data: {payload}\n\ndata: [DONE]\n\n".encode()


@dataclass
class Leg:
    """One upstream answer serving a client stream (its first, or a continuation)."""

    response: LegResponse
    url: str
    filter: ChunkFilter | None = None
    """This answer's own rewriting; what it holds back when the answer breaks (an
    incomplete event) is dropped."""
    on_close: Callable[[], None] | None = None
    """Called once when this answer is closed (releases its engine)."""
    broken: Callable[[], str | None] | None = None
    """After a clean end: why the answer is incomplete all the same (an in-band error
    event, no [DONE]), or None. Only set where another engine could take over."""
    cut: Callable[[], bool] | None = None
    """True once the rest of this answer is of no use (D's token 1 was not P's): stop
    reading it now rather than at its end; `broken` says why."""
    closed: bool = False


class Head(Protocol):
    """An event that may go to the client before the first leg's first chunk (push: P's
    token 1, router/legs/first_token.py): `ready` awaits it (None: there is none), `sent` is
    called once it went out, `lost` when a leg's chunk went first (again: no effect)."""

    async def ready(self) -> bytes | None: ...

    def sent(self) -> None: ...

    def lost(self) -> None: ...


Resume = Callable[[str, RouterError], Awaitable["Leg | bytes | RouterError"]]
"""Called with a broken leg's URL and what broke: the next leg, the stream's last bytes,
or the error to end the stream with."""


@dataclass
class StreamEvents:
    """What an `UpstreamStream` calls as the client's stream goes, and how it rewrites
    the client's bytes; built once per stream (the decode leg, from its observers). None:
    nothing to call, and nothing is checked per chunk for it.

    `first_chunk` is called once; `abort` (before the last close) when the stream did not
    end cleanly: the client went away, or a leg broke and no other took over; `success`
    when it did end cleanly. `rewrite` rewrites the client's bytes across legs;
    `before_done` is awaited once, before the upstream's `[DONE]` goes on (push: P's
    report, which the rewrite inserts there, may still be on its way); `recorded` once the
    `[DONE]` event has passed every filter, before it is sent (the turn's commit, which
    the filters start, stored where another router process will look). `chunks` is
    called once at the end with how many upstream chunks went straight to the client's
    connection and how many through the pump task."""

    first_chunk: Callable[[], None]
    error: Callable[[RouterError], None] | None = None
    abort: Callable[[], None] | None = None
    success: Callable[[], None] | None = None
    before_done: Callable[[], Awaitable[None]] | None = None
    rewrite: ChunkFilter | None = None
    recorded: Callable[[], Awaitable[None]] | None = None
    chunks: Callable[[int, int], None] | None = None


class UpstreamStream(Response):
    """Streams an upstream's body to the client, leg after leg when `resume` continues a
    broken one elsewhere; each leg is closed (its `on_close` called) exactly once. What it
    tells, and its rewriting: `events` (`StreamEvents`).

    The token path: under uvicorn's httptools server a chunk is handled where the
    upstream connection receives it, filtered and written to the client's connection
    (`_taker`, `direct_body.DirectBody`) without waking the pump task. The pump task
    reads whatever that path declines, in order: the chunks while a head event may still
    go first, the one with `[DONE]` when something must be awaited before it, all of them
    while the client's socket is full (the server's `send` then waits for the client)."""

    def __init__(
        self,
        first: Leg,
        *,
        leg: str,
        headers: Mapping[str, str],
        events: StreamEvents,
        resume: Resume | None = None,
        head: Head | None = None,
    ) -> None:
        self.current = first
        self.leg = leg
        self.status_code = first.response.status_code
        self.media_type = first.response.headers.get("content-type", "text/event-stream")
        self.background = None
        merged = {"cache-control": "no-cache", "x-accel-buffering": "no", **dict(headers)}
        self.init_headers(merged)
        self._on_first_chunk: Callable[[], None] | None = events.first_chunk
        self._on_error = events.error
        self._on_abort = events.abort
        self._filter = events.rewrite
        self._on_success = events.success
        self._resume = resume
        self._before_done = events.before_done
        self._recorded = events.recorded
        self._tail = b""  # the last bytes of the previous upstream chunk
        self._sent_all = False
        self._head = head
        self._first_leg = first
        self._relayed = False  # a chunk of a leg went on: the head is too late
        self._send_lock = asyncio.Lock()  # anyio's yields to the loop on every acquire
        self._direct: DirectBody | None = None
        self._busy = False  # the pump task holds a chunk it has not sent yet
        self._counted = events.chunks
        self._taken = 0  # chunks that went straight to the client
        self._pumped = 0  # chunks the pump task sent

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body_send = scope.get(RAW_SEND, send)
        ended: list[bool] = []
        try:
            async with anyio.create_task_group() as tg:

                async def pump() -> None:
                    ended.append(await self._pump(send, body_send))
                    tg.cancel_scope.cancel()

                # The pump is a task of its own: each chunk wakes its short stack, not
                # this coroutine's (the server's, the app's and its middlewares' frames).
                tg.start_soon(pump)
                while (await receive())["type"] != "http.disconnect":
                    pass
                if not self._sent_all:  # the server reports one after every response
                    log.info("client disconnected; closing %s stream from %s",
                             self.leg, self.current.url)
                tg.cancel_scope.cancel()
        finally:
            clean = bool(ended and ended[0])
            await _close(self.current)
            if self._counted is not None:
                self._counted(self._taken, self._pumped)
            if not clean and self._on_abort is not None:
                self._on_abort()
            if clean and self._on_success is not None:
                self._on_success()
        if self.background is not None:  # as Starlette's responses do, once all was sent
            await self.background()

    async def _pump(self, send: Send, body_send: Send) -> bool:
        """Send the legs' bodies; True when the stream ended without an error. The start
        goes through the app's own `send` (its middlewares track that a response started),
        the body through `body_send` (`RawSend`)."""
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        self._direct = direct_body(body_send)
        if self._head is None:
            return await self._legs(body_send)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._send_head, body_send)
            try:
                return await self._legs(body_send)
            finally:
                tg.cancel_scope.cancel()

    async def _send_head(self, send: Send) -> None:
        """The head event, through the first leg's filter, unless a leg's chunk went first."""
        head = self._head
        assert head is not None
        event = await head.ready()
        if event is None:
            return
        async with self._send_lock:
            leg = self.current
            if self._relayed or leg is not self._first_leg or leg.closed:
                head.lost()  # counted already, unless the first leg closed unread
                return
            data = leg.filter.feed(event) if leg.filter is not None else event
            head.sent()
            await self._to_client(send, data)

    async def _legs(self, send: Send) -> bool:
        while (err := await self._relay(self.current, send)) is not None:
            broken = self.current
            await _close(broken)
            nxt = await self._resume(broken.url, err) if self._resume is not None else err
            if isinstance(nxt, Leg):
                self.current = nxt
                continue
            if isinstance(nxt, bytes):
                await self._to_client(send, nxt)
                break
            log.warning("%s stream broke: %s", self.leg, nxt.message)
            if self._on_error is not None:
                self._on_error(nxt)
            event = sse_error_event(nxt.client_message, nxt.status, nxt.err_type)
            await send({"type": "http.response.body", "body": event, "more_body": True})
            self._sent_all = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return False
        if self._filter is not None and (tail := self._filter.flush()):
            await self._await_recorded(tail)
            await send({"type": "http.response.body", "body": tail, "more_body": True})
        self._sent_all = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True

    async def _relay(self, leg: Leg, send: Send) -> RouterError | None:
        """Pass one leg on; None when it ended complete, else what broke it.

        Per chunk only bytes searches and the filters' own fast paths; the send lock is
        taken only while a head event may still go first. Chunks `_taker` handled never
        come here."""
        flt, cut, resp = leg.filter, leg.cut, leg.response
        if self._direct is not None and isinstance(resp, StreamResponse):
            resp.take(self._taker(leg, self._direct))
        try:
            try:
                async for chunk in resp.aiter_bytes():
                    if not chunk:
                        continue
                    self._busy = True
                    self._pumped += 1
                    try:
                        await self._pump_chunk(leg, send, chunk)
                    finally:
                        self._busy = False
                    if cut is not None and cut():
                        break
            except Interrupt as stop:  # the taker's: a cut leg, or what a filter raised
                if stop.__cause__ is not None:
                    raise stop.__cause__ from None
            if flt is not None:
                await self._to_client(send, flt.flush())
        except httpx.HTTPError as exc:
            return from_transport(exc, self.leg, leg.url)
        reason = leg.broken() if leg.broken is not None else None
        if reason is None:
            return None
        return RouterError(502, f"{self.leg} upstream {leg.url} {reason}", "upstream_error",
                           self.leg, "stream_broken")

    async def _pump_chunk(self, leg: Leg, send: Send, chunk: bytes) -> None:
        """One chunk through the leg's filter and the stream's rewrite, to the client."""
        flt = leg.filter
        if self._on_first_chunk is not None:
            first, self._on_first_chunk = self._on_first_chunk, None
            first()
        if self._before_done is not None and DONE in self._tail + chunk:
            wait, self._before_done = self._before_done, None
            await wait()  # what `rewrite` adds before [DONE] may be due
        self._tail = chunk[-len(DONE) + 1:]  # a marker split across chunks
        if self._head is None or self._relayed:
            self._relayed = True
            await self._to_client(send, flt.feed(chunk) if flt is not None else chunk)
            return
        async with self._send_lock:
            if leg is self._first_leg:
                self._head.lost()  # no-op once it was sent
            self._relayed = True
            if flt is not None:
                chunk = flt.feed(chunk)
            await self._to_client(send, chunk)

    def _taker(self, leg: Leg, write: DirectBody) -> Callable[[bytes], bool]:
        """`leg`'s chunks handled where its connection receives them: what `_pump_chunk`
        does, with nothing to await. It declines (False: the pump task gets the chunk)
        while the pump task holds one, while a head event may still go first, while the
        client's socket is full, and from the `[DONE]` chunk on when `before_done` or
        `recorded` must be awaited before it goes."""
        flt, cut, resp = leg.filter, leg.cut, leg.response
        assert isinstance(resp, StreamResponse)

        def take(chunk: bytes) -> bool:
            if (self._busy or (self._head is not None and not self._relayed)
                    or self.current is not leg or not write.ready()):
                return False
            if self._before_done is not None or self._recorded is not None:
                if DONE in self._tail + chunk:
                    resp.untake()  # the pump task sends the rest
                    return False
                self._tail = chunk[-len(DONE) + 1:]
            try:
                if self._on_first_chunk is not None:
                    first, self._on_first_chunk = self._on_first_chunk, None
                    first()
                self._relayed = True
                data = flt.feed(chunk) if flt is not None else chunk
                if data and self._filter is not None:
                    data = self._filter.feed(data)
                if data:
                    write(data)
                self._taken += 1
                if cut is not None and cut():
                    resp.stop()
            except Exception as exc:  # raised in the pump task, as there
                resp.stop(exc)
            return True

        return take

    async def _to_client(self, send: Send, chunk: bytes) -> None:
        if chunk and self._filter is not None:
            chunk = self._filter.feed(chunk)
        if chunk:
            if self._recorded is not None:
                await self._await_recorded(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def _await_recorded(self, data: bytes) -> None:
        """Before `data` with the `[DONE]` event goes out: `recorded`, once. Filters pass
        whole events, so the marker is never split here."""
        if self._recorded is not None and DONE_EVENT in data:
            wait, self._recorded = self._recorded, None
            await wait()


async def _close(leg: Leg) -> None:
    """Close a leg's upstream answer (even while cancelled) and release it, once."""
    if leg.closed:
        return
    leg.closed = True
    try:
        with anyio.CancelScope(shield=True):
            await leg.response.aclose()
    finally:
        if leg.on_close is not None:
            leg.on_close()
