"""The floor of a Python router's CPU per streamed chunk (issue 33): a uvloop byte pipe,
each client connection spliced to a connection of its own to D, bytes copied both ways
unparsed (no HTTP parsing, no prefill leg, nothing filtered). Not a router: it answers only
while D does, and only for the bench's closed loop of keep-alive requests.

    taskset -c 1 python benchmarks/fake_engine.py 9101 & taskset -c 1 python benchmarks/fake_engine.py 9201 &
    taskset -c 0 python benchmarks/python_pipe_floor.py 9300 127.0.0.1 9201 &
    python benchmarks/router_dataplane.py --prefill http://127.0.0.1:9101 \\
      --decode http://127.0.0.1:9201 --kvferry http://127.0.0.1:9300 --impls kvferry,vllm-router

(the pipe's rows then say `impl: kvferry`; benchmarks/README.md names them for what they are).
"""

from __future__ import annotations

import asyncio
import sys

import uvloop


class Upstream(asyncio.Protocol):
    def __init__(self, client: asyncio.Transport) -> None:
        self.client = client

    def data_received(self, data: bytes) -> None:
        self.client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.close()


class Client(asyncio.Protocol):
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.up: asyncio.Transport | None = None
        self.early: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._connecting = asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        self.up, _ = await loop.create_connection(lambda: Upstream(self.transport),
                                                  self.host, self.port)
        for data in self.early:
            self.up.write(data)
        self.early = []

    def data_received(self, data: bytes) -> None:
        if self.up is None:
            self.early.append(data)
        else:
            self.up.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.up is not None:
            self.up.close()


async def main(port: int, host: str, d_port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Client(host, d_port), "127.0.0.1", port)
    await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3])))
