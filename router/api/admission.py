"""Admission: overload is refused, not failed.

A router process serves at most `max_active` completions at once (a stream counts until
its last byte is sent); up to `max_queued` more wait, first come first served, at most
`queue_timeout_s` each. A request finding the queue full gets 429, one whose wait ran out
503, both with `Retry-After`, before any engine work. Without the bound, a loop with more
streams than its core can relay gets late at everything: engine connects then time out
(502/504) and every stream's gaps grow. Engine connect and read timeouts start only once a
request is admitted (router/wire/stream_client.py), so queueing is never mistaken for a slow
engine.

An ASGI middleware, so it wraps the whole request, stream included, without touching
the per-chunk path (it passes `send` through unchanged).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections import deque
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import error_body

ADMITTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class Refused(Exception):
    """Not admitted: `status` 429 (queue full) or 503 (waited too long)."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


class Admission:
    """The bound and its FIFO queue (one event loop: no locks needed)."""

    def __init__(self, max_active: int, max_queued: int, queue_timeout_s: float) -> None:
        self.max_active = max_active
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.active = 0
        self._waiting: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def retry_after_s(self) -> int:
        """Seconds a refused client should wait: the queue's time bound, at least 1."""
        return max(1, math.ceil(min(self.queue_timeout_s, 30.0)))

    async def enter(self) -> None:
        """Return once admitted; raises `Refused`."""
        if self.active < self.max_active and not self._waiting:
            self.active += 1
            return
        if len(self._waiting) >= self.max_queued:
            raise Refused(429, "queue_full", f"router at capacity ({self.max_active} active, "
                          f"{self.max_queued} queued); retry later")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout_s)
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                return  # admitted just as the wait ran out: the slot is ours
            fut.cancel()
            self._forget(fut)
            raise Refused(503, "queue_timeout", f"router busy: not admitted within "
                          f"{self.queue_timeout_s:g} s; retry later") from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.leave()  # admitted, but the client left first: pass the slot on
            else:
                fut.cancel()
                self._forget(fut)
            raise

    def _forget(self, fut: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):
            self._waiting.remove(fut)

    def leave(self) -> None:
        """A request finished: its slot goes to the longest waiter, if any."""
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_result(None)  # `active` unchanged: the slot changes hands
                return
        self.active = max(0, self.active - 1)


class AdmissionMiddleware:
    """Applies `Admission` to the completions endpoints; `on_refused(path, kind)` counts."""

    def __init__(self, app: ASGIApp, admission: Admission,
                 on_refused: Callable[[str, str], None] | None = None) -> None:
        self.app = app
        self.admission = admission
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in ADMITTED_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            await self.admission.enter()
        except Refused as r:
            if self.on_refused is not None:
                self.on_refused(scope["path"], r.kind)
            await _refuse(send, r, self.admission.retry_after_s())
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.leave()


async def _refuse(send: Send, r: Refused, retry_after: int) -> None:
    err_type = "rate_limit_exceeded" if r.status == 429 else "service_unavailable"
    body = json.dumps(error_body(str(r), r.status, err_type)).encode()
    await send({"type": "http.response.start", "status": r.status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(retry_after).encode())]})
    await send({"type": "http.response.body", "body": body})
