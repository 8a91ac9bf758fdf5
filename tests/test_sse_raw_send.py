"""`RawSend`: a streamed answer's body chunks skip the app's send wrappers (the router's
per-chunk cost, issue 33), its start does not, and the client gets every byte either way."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvferry.router.wire.sse import Leg, RawSend, StreamEvents, UpstreamStream

CHUNKS = [f"data: {{\"i\": {i}}}\n\n".encode() for i in range(20)] + [b"data: [DONE]\n\n"]


class CountingMiddleware:
    """Counts the messages that pass through its send wrapper, by type."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.seen: dict[str, int] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def counted(message: Message) -> None:
            self.seen[message["type"]] = self.seen.get(message["type"], 0) + 1
            await send(message)

        await self.app(scope, receive, counted)


async def _upstream() -> AsyncIterator[bytes]:
    for chunk in CHUNKS:
        yield chunk


def _app() -> tuple[CountingMiddleware, list[int]]:
    """A Starlette app streaming CHUNKS through `UpstreamStream`, under a counting
    middleware; the list collects the stream's first-chunk calls."""
    first_chunks: list[int] = []

    async def stream(_request: Request) -> UpstreamStream:
        leg = Leg(response=httpx.Response(200, content=_upstream(),
                                          headers={"content-type": "text/event-stream"}),
                  url="http://decode")
        return UpstreamStream(leg, leg="decode", headers={},
                              events=StreamEvents(first_chunk=lambda: first_chunks.append(1)))

    app = Starlette(routes=[Route("/s", stream, methods=["POST"])])
    return CountingMiddleware(app.build_middleware_stack()), first_chunks


@pytest.mark.parametrize("raw", [True, False], ids=["raw-send", "wrapped"])
def test_body_chunks_skip_the_wrappers_and_all_bytes_arrive(raw: bool) -> None:
    counter, first_chunks = _app()
    outer: ASGIApp = RawSend(counter) if raw else counter

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=outer),
                                     base_url="http://router") as client:
            return await client.post("/s", content=b"{}")

    r = asyncio.run(post())
    assert r.status_code == 200
    assert r.content == b"".join(CHUNKS)
    assert r.headers["content-type"].startswith("text/event-stream")
    assert counter.seen.get("http.response.start") == 1
    # Without RawSend every chunk and the end pass the wrapper; with it none does.
    assert counter.seen.get("http.response.body", 0) == (0 if raw else len(CHUNKS) + 1)
    assert first_chunks == [1]  # the stream's own events still fire once
