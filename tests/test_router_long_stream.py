"""Long streams through the decode leg's reader (router/wire/stream_client.py): a taker
handles tens of thousands of chunks, and a reader reads them after it declines, without a
stall (aiohttp's reader, used before, stopped reading the connection after 16,384 recorded
chunk ends: a 16k-token answer stalled until the read timeout). A raw chunked HTTP server
sends more than that at once."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvferry.router.wire.stream_client import StreamClient

N = 40_000  # chunks: well past aiohttp 3.14's 16,384 recorded chunk ends (the old bound)


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


BURST = 500  # events per write: the reader's buffer empties between bursts


def _bursts(n: int) -> list[bytes]:
    events = [b"data: %d\n\n" % i for i in range(n)]
    framed = [b"%x\r\n%b\r\n" % (len(e), e) for e in events]
    return [b"".join(framed[i:i + BURST]) for i in range(0, n, BURST)] + [b"0\r\n\r\n"]


async def _stream(take_first: int | None) -> tuple[bytes, int, int]:
    """(the body's bytes in the order they came, pieces taken, pieces read) of one N-chunk
    answer; the taker takes the first `take_first` pieces (None: all) and declines the rest
    (a client socket that filled up). A taker is offered pieces only while nothing is buffered, so pieces
    taken and read, in the order they came, are the body."""
    bursts = _bursts(N)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(HEAD)
        await writer.drain()
        await asyncio.sleep(0.3)  # the body once the router holds the answer: all offered
        for burst in bursts:
            writer.write(burst)
            await writer.drain()
            await asyncio.sleep(0.002)
        await reader.read()  # until the client closes
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = StreamClient(max_connections=4, keepalive_s=5)
    got: list[bytes] = []
    offered = taken = read = 0

    def take(chunk: bytes) -> bool:
        nonlocal offered, taken
        offered += 1
        if take_first is not None and offered > take_first:
            return False
        got.append(chunk)
        taken += 1
        return True

    try:
        resp = await client.post(f"http://127.0.0.1:{port}/v1/completions", b"{}", {},
                                 httpx.Timeout(5.0, read=5.0))
        assert resp.take(take)
        async for chunk in resp.aiter_bytes():
            got.append(chunk)
            read += 1
        await resp.aclose()
    finally:
        await client.close()
        server.close()
    return b"".join(got), taken, read


@pytest.mark.parametrize("take_first", [None, N // 2], ids=["all_taken", "taken_then_read"])
def test_a_stream_longer_than_aiohttps_chunk_bound_never_stalls(take_first: int | None) -> None:
    body, taken, read = asyncio.run(asyncio.wait_for(_stream(take_first), 20))
    assert body == b"".join(b"data: %d\n\n" % i for i in range(N))
    if take_first is None:
        assert taken >= N and read == 0  # TCP may split an HTTP chunk: pieces >= chunks
    else:  # over 16,384 chunk ends read after as many taken
        assert taken == take_first and read >= 1
