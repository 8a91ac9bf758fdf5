"""The decode leg's socket fast path (router/wire/engine_conn.py `EngineConn`): a read that
holds exactly one whole HTTP chunk goes to the taker without the HTTP parser; every other
read goes through the parser. Whatever way TCP cuts the body (size lines cut short, several
chunks in one read, chunk extensions, bodies holding CRLF), the taker gets the body's bytes
in order, each once, and the watchdog's byte count sees all of them."""

from __future__ import annotations

import asyncio
import random

import pytest
from helpers_raw_engine import take_then_read


def _events(n: int, rng: random.Random) -> list[bytes]:
    out = []
    for i in range(n):
        text = rng.choice([b"x", b"\r\n", b"0\r\n\r\n", b"a" * rng.randint(1, 300), b"\r"])
        out.append(b'data: {"i":%d,"t":"%b"}\n\n' % (i, text))
    return out


def _frame(event: bytes, ext: bool = False) -> bytes:
    return b"%x%b\r\n%b\r\n" % (len(event), b";x=1" if ext else b"", event)


async def _run(writes: list[bytes], pause_s: float, decline_every: int = 0
               ) -> tuple[bytes, int, int]:
    """(what the taker got, chunks taken from the socket, the answer's byte count). The
    taker declines every `decline_every`th offer (a client socket that is full): that
    piece and what follows while it is buffered are read instead."""
    got: list[bytes] = []
    offers = 0

    def take(chunk: bytes) -> bool:
        nonlocal offers
        offers += 1
        if decline_every and offers % decline_every == 0:
            return False
        got.append(chunk)
        return True

    resp = await take_then_read([*writes, b"0\r\n\r\n"], pause_s, take, got)
    return b"".join(got), resp.frames, resp.total_bytes


def _loop_run(coro, loop: str):  # noqa: ANN001, ANN202 - the router's loop and asyncio's
    if loop == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_one_chunk_per_read_skips_the_parser(loop: str) -> None:
    events = _events(200, random.Random(1))
    body, frames, total = _loop_run(_run([_frame(e) for e in events], 0.002), loop)
    assert body == b"".join(events)
    assert total == len(body)
    assert frames >= len(events) - 5  # the first goes through the parser (no boundary yet)


@pytest.mark.parametrize("decline_every", [0, 7])
@pytest.mark.parametrize("seed", range(4))
def test_any_cut_of_the_body_reaches_the_taker_whole_and_in_order(
        seed: int, decline_every: int) -> None:
    rng = random.Random(seed)
    events = _events(300, rng)
    pieces: list[bytes] = []
    for e in events:  # runs of whole chunks, and runs cut anywhere (or merged)
        framed = _frame(e, ext=rng.random() < 0.1)
        if rng.random() < 0.5 or not pieces:
            pieces.append(framed)
        else:
            joined = pieces.pop() + framed
            cut = rng.randint(1, len(joined) - 1)
            pieces += [joined[:cut], joined[cut:]]
    body, frames, total = _loop_run(_run(pieces, 0.001, decline_every),
                                    "uvloop" if seed % 2 else "asyncio")
    assert body == b"".join(events)
    assert total == len(body)
    assert frames > 0


def test_whole_chunks_after_cut_ones_are_taken_again() -> None:
    """A size line cut short (no hook fires for it) leaves no boundary behind: the chunk it
    starts goes through the parser, the whole ones after it skip it again."""
    events = _events(60, random.Random(7))
    framed = [_frame(e) for e in events]
    writes = framed[:20] + [framed[20][:1], framed[20][1:]] + framed[21:]
    body, frames, _ = _loop_run(_run(writes, 0.003), "uvloop")
    assert body == b"".join(events)
    assert frames >= 50


def test_a_size_line_cut_short_is_never_taken_for_a_whole_chunk() -> None:
    """`00` + `1a\\r\\n<26 bytes>\\r\\n` would read as one whole chunk if the boundary
    outlived the cut: the parser has the `00` and would take the next size line for this
    chunk's body. Leading zeros make the rest of the cut line a valid size line."""
    events = [b"data: %026d\n\n" % i for i in range(40)]
    framed = [b"%04x\r\n%b\r\n" % (len(e), e) for e in events]
    writes: list[bytes] = []
    for i, f in enumerate(framed):
        if i % 3 == 1:  # the parser ends the last chunk, then reads a size line's `00`
            writes += [writes.pop() + f[:2], f[2:]]
        else:
            writes.append(f)
    body, frames, total = _loop_run(_run(writes, 0.003), "uvloop")
    assert body == b"".join(events)
    assert total == len(body)
    assert frames > 0
