"""Pass an upstream SSE stream to the client chunk by chunk.

Written as a raw ASGI response (not StreamingResponse) so that the upstream stream is
closed in every case: normal end, upstream error, and client disconnect (watched on
`receive` for all ASGI servers, not only those that raise on send).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping

import anyio
import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .errors import RouterError, error_body, from_transport

log = logging.getLogger(__name__)


def sse_error_event(message: str, status: int, err_type: str) -> bytes:
    """An in-band error event plus [DONE], for failures after headers were sent."""
    payload = json.dumps(error_body(message, status, err_type))
    return f"data: {payload}\n\ndata: [DONE]\n\n".encode()


class UpstreamStream(Response):
    """Streams `upstream`'s body; calls `on_first_chunk` once and `on_close` exactly once."""

    def __init__(
        self,
        upstream: httpx.Response,
        *,
        leg: str,
        url: str,
        headers: Mapping[str, str],
        on_first_chunk: Callable[[], None],
        on_close: Callable[[], None],
        on_error: Callable[[RouterError], None] | None = None,
    ) -> None:
        self.upstream = upstream
        self.leg = leg
        self.url = url
        self.status_code = upstream.status_code
        self.media_type = upstream.headers.get("content-type", "text/event-stream")
        self.background = None
        merged = {"cache-control": "no-cache", "x-accel-buffering": "no", **dict(headers)}
        self.init_headers(merged)
        self._on_first_chunk = on_first_chunk
        self._on_close = on_close
        self._on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def watch_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    log.info("client disconnected; closing %s stream from %s", self.leg, self.url)
                    tg.cancel_scope.cancel()

                tg.start_soon(watch_disconnect)
                await self._pump(send)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()
            self._on_close()

    async def _pump(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        first = True
        try:
            async for chunk in self.upstream.aiter_bytes():
                if not chunk:
                    continue
                if first:
                    first = False
                    self._on_first_chunk()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as exc:
            err = from_transport(exc, self.leg, self.url)
            log.warning("%s stream broke: %s", self.leg, err.message)
            if self._on_error is not None:
                self._on_error(err)
            event = sse_error_event(err.message, err.status, err.err_type)
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
