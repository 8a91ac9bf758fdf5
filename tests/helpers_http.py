"""Real-HTTP test helpers: uvicorn servers in threads and a fake vLLM engine.

Kept out of conftest.py so other test modules can import it without fixture clashes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvferry.connectors.protocol.lease import LeaseError
from kvferry.router.wire.headers import OPERATOR_TOKEN_ENV, OPERATOR_TOKEN_HEADER
from kvferry.router.wire.sse import RawSend
from kvferry.scripts import procs

_GIVEN: set[int] = set()

OPERATOR_TOKEN = os.environ.setdefault(OPERATOR_TOKEN_ENV, "tests-operator-token")
"""Every router the tests start (in process or not) takes this operator token."""
OPERATOR = {OPERATOR_TOKEN_HEADER: OPERATOR_TOKEN}
"""Headers of a request from the deployment's operator: it sees which engines served it."""


def engine_name(router: str, engine: str) -> str:
    """The name the router at `router` gives the engine at `engine` in its metrics (only
    the operator's /health maps names to URLs)."""
    import httpx

    view = httpx.get(router + "/health", headers=OPERATOR, timeout=10, trust_env=False).json()
    return next(e["name"] for role in ("prefill", "decode") for e in view[role]
                if e["url"] == engine)


def healthy(url: str) -> bool:
    """``url``'s /health answers 200 (a started fake or router is serving)."""
    import httpx

    try:
        return httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, below the OS's ephemeral range (engines bind it
    tens of seconds later), and procs.PORT_GAP (8) from every other port handed out in
    this process, because engines also bind port + TP rank."""
    return procs.free_port(_GIVEN)


def lease_reason(keeper: Any, lease_id: str) -> str | None:
    """Why ``keeper`` (a LeaseKeeper) no longer serves ``lease_id`` (None: it does): what
    the fake decode engines of the router tests report."""
    try:
        keeper.info(lease_id)
    except LeaseError as e:
        return e.reason
    return None


class ServerThread:
    """Runs an ASGI app under uvicorn on 127.0.0.1:<free port> in a daemon thread, as
    `kvferry router` does (wrapped in `RawSend`)."""

    def __init__(self, app: Any, http: str = "auto") -> None:
        config = uvicorn.Config(
            RawSend(app), host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=1,
            http=http,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> str:
        """Start and return the base URL once the socket is listening."""
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        """Ask uvicorn to exit and wait for the thread."""
        self.server.should_exit = True
        self.thread.join(timeout=10)


@contextmanager
def serve(app: Any, http: str = "auto") -> Iterator[str]:
    """Context manager form of ServerThread: yields the base URL. ``http``: uvicorn's
    HTTP implementation (auto: httptools, as `kvferry router` runs)."""
    srv = ServerThread(app, http)
    url = srv.start()
    try:
        yield url
    finally:
        srv.stop()


def closed_port_url() -> str:
    """A URL on which nothing listens (connection refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@contextmanager
def dropping_server() -> Iterator[tuple[str, list[bytes]]]:
    """(URL, requests received): an engine that dies holding the request. Each connection
    is read until its body is complete, then closed without an answer ("Server
    disconnected without sending a response"); `/health` is dropped the same way."""
    got: list[bytes] = []
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve_forever() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                data = b""
                with contextlib.suppress(OSError):
                    while b"\r\n\r\n" not in data:
                        data += conn.recv(65536) or b"!"
                    head, _, rest = data.partition(b"\r\n\r\n")
                    n = next((int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                              if ln.lower().startswith(b"content-length:")), 0)
                    while len(rest) < n:
                        rest += conn.recv(65536) or b"!" * n
                got.append(head + b"\r\n\r\n" + rest)

    t = threading.Thread(target=serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}", got
    finally:
        stop.set()
        t.join(timeout=2)
        srv.close()


@dataclass
class FakeEngine:
    """Behaviour and records of one fake vLLM OpenAI server."""

    name: str
    kv_params: dict[str, Any] | None = None
    delay_s: float = 0.0
    status: int = 200
    chunks: int = 4
    chunk_delay_s: float = 0.0
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    chunk_sent_at: list[float] = field(default_factory=list)
    stream_closed_early: threading.Event = field(default_factory=threading.Event)
    disconnected: threading.Event = field(default_factory=threading.Event)
    """Set when a client closed its request while this engine was still delaying."""
    received_at: list[float] = field(default_factory=list)
    answered_at: list[float] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    script: Any = None
    """Optional `script(body, chat) -> (json_answer, sse_events)`: the exact answer bytes a
    given engine version sends (e.g. vLLM 0.33's, serialized by its own classes)."""

    def app(self) -> FastAPI:
        """FastAPI app answering like vLLM's OpenAI server (enough for the router)."""
        app = FastAPI()
        eng = self

        async def answer(request: Request, chat: bool) -> Any:
            body = await request.json()
            eng.received_at.append(time.monotonic())
            eng.received.append(body)
            eng.headers.append(dict(request.headers))
            eng.in_flight += 1
            eng.max_in_flight = max(eng.max_in_flight, eng.in_flight)
            try:
                if eng.delay_s:
                    deadline = time.monotonic() + eng.delay_s
                    while (left := deadline - time.monotonic()) > 0:
                        await asyncio.sleep(min(left, 0.02))
                        if await request.is_disconnected():
                            eng.disconnected.set()
                            return JSONResponse({}, status_code=499)
                eng.answered_at.append(time.monotonic())
                if eng.status != 200:
                    msg = {"error": {"message": f"{eng.name} says {eng.status}"}}
                    return JSONResponse(msg, status_code=eng.status)
                if eng.script is not None:
                    answer_json, events = eng.script(body, chat)
                    if body.get("stream"):
                        return StreamingResponse(_replay(events), media_type="text/event-stream")
                    return JSONResponse(json.loads(answer_json))
                if body.get("stream"):
                    eng.in_flight += 1  # held until the stream ends
                    return StreamingResponse(eng._sse(chat), media_type="text/event-stream")
                out: dict[str, Any] = {
                    "id": f"{eng.name}-1",
                    "object": "chat.completion" if chat else "text_completion",
                    "model": body.get("model", "tiny"),
                    "choices": [_choice(chat, f"{eng.name} answer", final=True)],
                    "kv_transfer_params": eng.kv_params,
                }
                return JSONResponse(out)
            finally:
                eng.in_flight -= 1

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await answer(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            return await answer(request, chat=True)

        @app.get("/v1/models")
        async def models() -> Any:
            return {"object": "list", "data": [{"id": "tiny", "object": "model",
                                                "owned_by": eng.name}]}

        @app.get("/health")
        async def health() -> Any:
            return {}

        return app

    async def _sse(self, chat: bool) -> AsyncIterator[bytes]:
        finished = False
        try:
            for i in range(self.chunks):
                if i and self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
                chunk = {"id": f"{self.name}-s", "choices": [_choice(chat, f"tok{i} ", False)]}
                self.chunk_sent_at.append(time.monotonic())
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            self.in_flight -= 1
            if not finished:
                self.stream_closed_early.set()


async def _replay(events: list[bytes]) -> AsyncIterator[bytes]:
    for e in events:
        yield e


def _choice(chat: bool, text: str, final: bool) -> dict[str, Any]:
    if chat:
        key = "message" if final else "delta"
        return {"index": 0, key: {"role": "assistant", "content": text},
                "finish_reason": "stop" if final else None}
    return {"index": 0, "text": text, "finish_reason": "stop" if final else None}


def main() -> None:
    """`python tests/helpers_http.py PORT NAME`: a fake engine process (for CLI tests)."""
    import sys

    port, name = int(sys.argv[1]), sys.argv[2]
    kv = {"remote_engine_id": name, "remote_block_ids": [1]} if name == "prefill" else None
    eng = FakeEngine(name, kv_params=kv, chunks=3)
    uvicorn.run(eng.app(), host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main()
