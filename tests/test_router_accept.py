"""`accept.Acceptor`: the router's client connections are accepted all at once when the
listening socket is readable, under asyncio's loop and uvloop's alike (uvloop's own
listener leaves them queued while its loop is busy: router/api/accept.py)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import pytest
import uvloop

from kvferry.router.api import accept

CLIENTS = 64


class Hello(asyncio.Protocol):
    made: list[asyncio.BaseTransport]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        Hello.made.append(transport)
        transport.write(b"hi")  # type: ignore[attr-defined]


async def _until(pred, turns: int = 1000) -> None:  # noqa: ANN001
    for _ in range(turns):
        if pred():
            return
        await asyncio.sleep(0)
    raise AssertionError("the loop never got there")


async def _scenario() -> None:
    loop = asyncio.get_running_loop()
    Hello.made = []
    sock = accept.bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    # every client is connected (the kernel's handshake) before the acceptor first runs
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(CLIENTS)]
    acceptor = accept.Acceptor(sock, Hello, loop)
    await _until(lambda: acceptor.accepted > 0)
    assert acceptor.accepted == CLIENTS  # the whole queue in the first wake
    await _until(lambda: len(Hello.made) == CLIENTS)
    for c in clients:
        c.settimeout(5)
        assert c.recv(2) == b"hi"  # each one served by the server's protocol
    acceptor.close()  # as the drain starts: no more accepting
    late = socket.create_connection(("127.0.0.1", port))
    for _ in range(50):
        await asyncio.sleep(0.001)
    assert acceptor.accepted == CLIENTS
    for c in [*clients, late]:
        c.close()
    for t in Hello.made:
        t.close()
    sock.close()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_the_whole_accept_queue_is_taken_at_once_and_close_stops_it(loop: str) -> None:
    if loop == "uvloop":
        uvloop.run(_scenario())
    else:
        asyncio.run(_scenario())


def test_a_router_whose_port_is_taken_says_so_and_exits_3() -> None:
    """`kvferry router` binds its socket itself now: a busy port is uvicorn's
    startup-failure status, as before (and a lone router never shares a port: no
    SO_REUSEPORT)."""
    holder = accept.bind("127.0.0.1", 0)
    port = holder.getsockname()[1]
    try:
        r = subprocess.run([sys.executable, "-m", "kvferry.scripts.cli", "router", "--prefill",
                            "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9", "--port",
                            str(port), "--health-interval", "0"],
                           capture_output=True, text=True, timeout=120)
    finally:
        holder.close()
    assert r.returncode == 3, r.stderr[-2000:]
