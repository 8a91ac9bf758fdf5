"""Long streams through the decode leg's reader (router/wire/stream_client.py): a taker
handles tens of thousands of chunks, and a reader reads them after it declines, without a
stall (aiohttp's reader, used before, stopped reading the connection after 16,384 recorded
chunk ends: a 16k-token answer stalled until the read timeout). A raw chunked HTTP server
sends more than that at once."""

from __future__ import annotations

import asyncio

import pytest
from helpers_raw_engine import take_then_read

N = 40_000  # chunks: well past aiohttp 3.14's 16,384 recorded chunk ends (the old bound)


BURST = 500  # events per write: the reader's buffer empties between bursts


def _bursts(n: int) -> list[bytes]:
    events = [b"data: %d\n\n" % i for i in range(n)]
    framed = [b"%x\r\n%b\r\n" % (len(e), e) for e in events]
    return [b"".join(framed[i:i + BURST]) for i in range(0, n, BURST)] + [b"0\r\n\r\n"]


async def _stream(take_first: int | None) -> tuple[bytes, int, int]:
    """(the body's bytes in the order they came, pieces taken, pieces read) of one N-chunk
    answer; the taker takes the first `take_first` pieces (None: all) and declines the rest
    (a client socket that filled up)."""
    got: list[bytes] = []
    offered = taken = 0

    def take(chunk: bytes) -> bool:
        nonlocal offered, taken
        offered += 1
        if take_first is not None and offered > take_first:
            return False
        got.append(chunk)
        taken += 1
        return True

    await take_then_read(_bursts(N), 0.002, take, got)
    return b"".join(got), taken, len(got) - taken


@pytest.mark.parametrize("take_first", [None, N // 2], ids=["all_taken", "taken_then_read"])
def test_a_stream_longer_than_aiohttps_chunk_bound_never_stalls(take_first: int | None) -> None:
    body, taken, read = asyncio.run(asyncio.wait_for(_stream(take_first), 20))
    assert body == b"".join(b"data: %d\n\n" % i for i in range(N))
    if take_first is None:
        assert taken >= N and read == 0  # TCP may split an HTTP chunk: pieces >= chunks
    else:  # over 16,384 chunk ends read after as many taken
        assert taken == take_first and read >= 1
