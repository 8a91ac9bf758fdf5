"""The legs' HTTP/1.1 client (router/wire/stream_client.py) against raw engines: pooled
keep-alive connections, answers framed by length, by chunks or by a close, and the httpx
errors each failure maps to (`errors.from_transport` tells "never sent" from "broke")."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import httpx
import pytest

from kvferry.router.wire.stream_client import StreamClient

T = httpx.Timeout(5.0, connect=2.0)
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _with_server(handle: Handler, body: Callable[[str, StreamClient], Awaitable[object]]
                       ) -> object:
    conns = []

    async def counted(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns.append(w)
        await handle(r, w)

    server = await asyncio.start_server(counted, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
    client = StreamClient(8, 4.0)
    try:
        return await body(url, client), len(conns)
    finally:
        await client.close()
        server.close()


async def _request(r: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await r.readuntil(b"\r\n\r\n")
    length = next(int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                  if ln.lower().startswith(b"content-length"))
    return head, await r.readexactly(length)


def test_answers_by_length_reuse_one_connection_and_see_the_request() -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            try:
                head, body = await _request(r)
            except asyncio.IncompleteReadError:
                return
            seen.append((head, body))
            out = b'{"ok":%d}' % len(seen)
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%b" % (len(out), out))

    async def body(url: str, client: StreamClient) -> list[object]:
        return [(await client.fetch(url, b'{"n":%d}' % i, {"x-request-id": "r1"}, T)).json()
                for i in range(3)]

    (answers, n_conns) = asyncio.run(_with_server(handle, body))
    assert answers == [{"ok": 1}, {"ok": 2}, {"ok": 3}]
    assert n_conns == 1  # keep-alive: one connection for three requests
    head, req = seen[0]
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"\r\nx-request-id: r1\r\n" in head and b"\r\nUser-Agent: kvferry-router\r\n" in head
    assert req == b'{"n":0}'


def test_a_connection_close_answer_is_not_reused_and_a_close_ends_its_body() -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _request(r)
        w.write(b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n"
                b"Retry-After: 2\r\n\r\nbusy")
        await w.drain()
        w.close()

    async def body(url: str, client: StreamClient) -> list[tuple[int, str, bytes]]:
        out = []
        for _ in range(2):
            a = await client.fetch(url, b"{}", {}, T)
            out.append((a.status_code, a.headers["retry-after"], a.content))
        return out

    answers, n_conns = asyncio.run(_with_server(handle, body))
    assert answers == [(503, "2", b"busy")] * 2
    assert n_conns == 2


def test_an_idle_connection_the_engine_closed_is_not_used_again() -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await w.drain()
        await asyncio.sleep(0.05)
        w.close()  # keep-alive ended by the engine while the router's copy is idle

    async def body(url: str, client: StreamClient) -> list[bytes]:
        first = (await client.fetch(url, b"{}", {}, T)).content
        await asyncio.sleep(0.2)
        return [first, (await client.fetch(url, b"{}", {}, T)).content]

    answers, n_conns = asyncio.run(_with_server(handle, body))
    assert answers == [b"ok", b"ok"]
    assert n_conns == 2


def test_a_refused_connection_is_a_connect_error() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()

    async def run() -> None:
        client = StreamClient(8, 4.0)
        try:
            await client.post(f"http://127.0.0.1:{port}/x", b"{}", {}, T)
        finally:
            await client.close()

    with pytest.raises(httpx.ConnectError):
        asyncio.run(run())


@pytest.mark.parametrize("answer", [b"", b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
                                    b"NOT HTTP AT ALL\r\n\r\n"],
                         ids=["closed_before_answering", "closed_mid_body", "malformed"])
def test_a_broken_answer_is_a_protocol_error_after_the_bytes_that_came(answer: bytes) -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _request(r)
        w.write(answer)
        await w.drain()
        w.close()

    async def body(url: str, client: StreamClient) -> tuple[type, bytes]:
        got = b""
        try:
            resp = await client.post(url, b"{}", {}, T)
            async for chunk in resp.aiter_bytes():
                got += chunk
            await resp.aclose()
        except httpx.HTTPError as exc:
            return type(exc), got
        return type(None), got

    (kind, got), _ = asyncio.run(_with_server(handle, body))
    assert kind is httpx.RemoteProtocolError
    assert got == (b"short" if answer.endswith(b"short") else b"")


def test_a_silent_engine_is_a_read_timeout() -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _request(r)
        await asyncio.sleep(2)

    async def body(url: str, client: StreamClient) -> None:
        await client.post(url, b"{}", {}, httpx.Timeout(0.3, connect=2.0))

    with pytest.raises(httpx.ReadTimeout):
        asyncio.run(_with_server(handle, body))


def test_a_header_with_a_line_break_is_never_sent() -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        raise AssertionError("nothing may reach the engine")

    async def body(url: str, client: StreamClient) -> None:
        await client.post(url, b"{}", {"authorization": "Bearer x\r\nx-evil: 1"}, T)

    with pytest.raises(httpx.LocalProtocolError):
        asyncio.run(_with_server(handle, body))
