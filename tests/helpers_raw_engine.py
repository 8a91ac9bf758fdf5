"""A raw chunked engine for the legs' HTTP client (router/wire/stream_client.py): it
writes an answer's bytes exactly as given, so tests control how TCP cuts them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx

from kvferry.router.wire.engine_conn import StreamResponse
from kvferry.router.wire.stream_client import StreamClient

CHUNKED_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n")


async def take_then_read(writes: list[bytes], pause_s: float, take: Callable[[bytes], bool],
                         got: list[bytes]) -> StreamResponse:
    """One POST to a raw engine that sends `CHUNKED_HEAD`, waits until the answer is taken,
    then sends `writes` `pause_s` apart (they end the body). The client offers the body to
    `take` and appends what `take` declined to `got` as it reads it; a taker is offered
    pieces only while nothing is buffered, so what it kept and `got`, in the order they
    came, are the body. Returns the answer, closed."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(CHUNKED_HEAD)
        await writer.drain()
        await asyncio.sleep(0.3)  # the body once the client holds the answer: all offered
        for w in writes:
            writer.write(w)
            await writer.drain()
            await asyncio.sleep(pause_s)
        await reader.read()  # until the client closes
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = StreamClient(max_connections=4, keepalive_s=5)
    try:
        resp = await client.post(f"http://127.0.0.1:{port}/v1/completions", b"{}", {},
                                 httpx.Timeout(5.0, read=5.0))
        assert resp.take(take)
        async for chunk in resp.aiter_bytes():
            got.append(chunk)
        await resp.aclose()
    finally:
        await client.close()
        server.close()
    return resp
