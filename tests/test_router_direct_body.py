"""The stream's direct path (router/wire/direct_body.py, `sse.UpstreamStream._taker`):
under uvicorn's httptools server D's chunks go to the client where D's connection
receives them; what that path declines goes through the pump task, in order. Real HTTP
on both sides: fake engines under uvicorn, the router under uvicorn, httpx clients."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from helpers_http import serve

from kvferry.router.api.app import create_app
from kvferry.router.settings import RouterSettings


def engine(events: int, text_len: int, gap_s: float, stall_after: int | None = None) -> FastAPI:
    """P answers the prefill leg; D streams `events` token events of `text_len` chars,
    `gap_s` apart, the last one carrying vLLM 0.33's `kv_transfer_params`, then [DONE];
    `stall_after`: it goes silent after that many events."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        if not body.get("stream"):
            return JSONResponse({"id": "p", "choices": [{"index": 0, "text": "t",
                                                         "finish_reason": "length"}],
                                 "kv_transfer_params": {"remote_engine_id": "p0",
                                                        "remote_block_ids": [1]}})

        async def gen() -> AsyncIterator[bytes]:
            for i in range(events):
                if i == stall_after:
                    await asyncio.sleep(30)
                last = i == events - 1
                ev: dict[str, Any] = {"id": "d", "object": "text_completion", "created": 1,
                                      "model": "fake", "choices": [{
                                          "index": 0, "text": f"{i:06d}" + "x" * text_len,
                                          "logprobs": None,
                                          "finish_reason": "length" if last else None,
                                          "stop_reason": None, "token_ids": [100 + i]}]}
                if last:
                    ev["kv_transfer_params"] = {"remote_host": "10.0.0.9", "lease": {}}
                yield f"data: {json.dumps(ev, separators=(',', ':'))}\n\n".encode()
                await asyncio.sleep(gap_s)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.get("/health")
    async def health() -> Any:
        return {}

    return app


def chunk_paths(app: Any) -> dict[str, float]:
    """The stream's chunk counts, once published: when its handler ends, which may be
    just after the client has read the last byte."""
    reg = app.state.metrics.registry
    deadline = time.monotonic() + 5
    while True:
        got = {p: reg.get_sample_value("kvferry_router_stream_chunks_total", {"path": p}) or 0.0
               for p in ("direct", "pump")}
        if sum(got.values()) or time.monotonic() > deadline:
            return got
        time.sleep(0.01)


def check(raw: bytes, events: int) -> None:
    """Every event once, in order, no engine field, one [DONE] at the end."""
    assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"[DONE]") == 1
    got = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    assert [int(e["choices"][0]["text"][:6]) for e in got] == list(range(events))
    assert b"kv_transfer_params" not in raw and b"10.0.0.9" not in raw
    assert all(e["choices"][0]["token_ids"] is None for e in got)  # asked by the router


def router(http: str, n_events: int, text_len: int, gap_s: float = 0.0,  # noqa: ANN201
           stall_after: int | None = None, **settings: Any):
    class Stack:
        def __enter__(self) -> tuple[str, Any]:
            self.p = serve(engine(n_events, text_len, gap_s))
            self.d = serve(engine(n_events, text_len, gap_s, stall_after))
            purl, durl = self.p.__enter__(), self.d.__enter__()
            self.app = create_app(RouterSettings(prefill_urls=[purl], decode_urls=[durl],
                                                 health_interval_s=0, **settings), b"k")
            self.r = serve(self.app, http)
            return self.r.__enter__(), self.app

        def __exit__(self, *exc: Any) -> None:
            for cm in (self.r, self.d, self.p):
                cm.__exit__(None, None, None)

    return Stack()


BODY = {"model": "fake", "prompt": "hi", "max_tokens": 400, "stream": True}


# Which path a chunk takes depends on the pump task keeping up with D's 2 ms gaps. On two
# cores shared with CI's engine run a CI run counted 0 chunks direct (every chunk came
# while the pump still held one or had one buffered, when the direct path must decline to
# keep the order), and before this session's changes, under a busy loop on both cores, 296
# direct and 1 pumped read of the rest joined. Everything still arrived whole and in
# order. These path counts are timing: `.ci/test` runs them alone.
@pytest.mark.timing
def test_token_chunks_go_direct_and_arrive_whole_in_order() -> None:
    with router("auto", 300, 20, gap_s=0.002) as (url, app):
        with httpx.stream("POST", url + "/v1/completions", json=BODY, timeout=20,
                          trust_env=False) as r:
            assert r.status_code == 200
            raw = r.read()
        check(raw, 300)
        paths = chunk_paths(app)
        # nearly every chunk direct; the pump task gets what arrived with D's headers
        assert paths["direct"] >= 250 and paths["direct"] + paths["pump"] >= 300


@pytest.mark.timing  # how the pump's reads join chunks depends on timing (see above)
def test_a_client_that_stops_reading_gets_everything_through_the_pump() -> None:
    """The client's socket fills (small receive buffer, nothing read for a while): the
    direct path declines and the pump task waits for the client, as the server's send
    does; nothing is lost, duplicated or reordered."""
    n, size = 400, 25_000  # 10 MB: more than the sockets' buffers hold (4 MB at most)
    small = httpx.HTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 32_768)])
    with router("auto", n, size) as (url, app), httpx.Client(transport=small,
                                                              trust_env=False) as c:
        with c.stream("POST", url + "/v1/completions", json=BODY, timeout=30) as r:
            assert r.status_code == 200
            it = r.iter_raw()
            raw = next(it)
            time.sleep(1.0)  # the router's writes to this client back up meanwhile
            raw += b"".join(it)
        check(raw, n)
        paths = chunk_paths(app)
        assert paths["pump"] > 1 and paths["direct"] > 0  # the pump's reads join chunks


@pytest.mark.parametrize("http", ["h11"])
def test_other_servers_get_every_chunk_through_send(http: str) -> None:
    with router(http, 50, 20, gap_s=0.002) as (url, app):
        with httpx.stream("POST", url + "/v1/completions", json=BODY, timeout=20,
                          trust_env=False) as r:
            raw = r.read()
        check(raw, 50)
        assert chunk_paths(app)["direct"] == 0 and chunk_paths(app)["pump"] > 0


def test_a_stream_whose_engine_goes_silent_ends_within_its_read_timeout() -> None:
    """The read timeout of a stream whose chunks go direct (the watchdog reads the body's
    byte count): D stalls after 20 events; the client has those 20, then an error event
    and [DONE], within the decode timeout plus the watchdog's slack, not D's 30 s."""
    with router("auto", 100, 20, gap_s=0.002, stall_after=20, decode_timeout_s=0.5) as (url, app):
        t0 = time.monotonic()
        with httpx.stream("POST", url + "/v1/completions", json=BODY, timeout=20,
                          trust_env=False) as r:
            raw = r.read()
        took = time.monotonic() - t0
    events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    assert [int(e["choices"][0]["text"][:6]) for e in events[:-1]] == list(range(20))
    assert "error" in events[-1] and raw.endswith(b"data: [DONE]\n\n")
    assert 0.5 <= took < 3
    assert chunk_paths(app)["direct"] > 0


# -- the taker's own ends: a cut leg, a filter that raises (sse.UpstreamStream._taker) ------
class Counting:
    """A leg filter that passes chunks on and counts them; `raise_at`: raises on that one."""

    def __init__(self, raise_at: int | None = None) -> None:
        self.n = 0
        self.raise_at = raise_at

    def feed(self, chunk: bytes) -> bytes:
        self.n += 1
        if self.n == self.raise_at:
            raise ValueError("filter bug")
        return chunk

    def flush(self) -> bytes:
        return b""


def one_leg_app(durl: str, flt: Counting, cut_after: int | None, seen: dict[str, Any]) -> Any:
    """An ASGI app streaming D's answer through one `UpstreamStream` leg with `flt`."""
    from kvferry.router.wire.sse import Leg, StreamEvents, UpstreamStream
    from kvferry.router.wire.stream_client import StreamClient

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        client = StreamClient(4, 30)
        try:
            resp = await client.post(durl + "/v1/completions",
                                     json.dumps({**BODY, "max_tokens": 50}).encode(),
                                     {"content-type": "application/json"}, httpx.Timeout(5))
            leg = Leg(resp, durl, flt, cut=(lambda: flt.n >= cut_after) if cut_after else None)
            events = StreamEvents(lambda: None, chunks=lambda d, p: seen.update(direct=d, pump=p))
            try:
                await UpstreamStream(leg, leg="decode", headers={}, events=events)(
                    scope, receive, send)
            except* ValueError as group:  # from the stream's task group
                seen["raised"] = [str(e) for e in group.exceptions]
                raise
        finally:
            await client.close()

    return app


def test_a_leg_cut_on_the_direct_path_stops_reading_it_there() -> None:
    """`cut` true after the 3rd chunk the taker handled: nothing after it reaches the
    client, and the stream ends cleanly."""
    seen: dict[str, Any] = {}
    flt = Counting()
    with (serve(engine(30, 10, 0.01)) as durl, serve(one_leg_app(durl, flt, 3, seen)) as url,
          httpx.stream("POST", url, json={}, timeout=10, trust_env=False) as r):
        raw = r.read()
    got = [e for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    assert len(got) == 3 and flt.n == 3 and b"[DONE]" not in raw
    assert seen["direct"] >= 2  # the first chunk may come with D's headers (pump)


def test_a_filter_that_raises_on_the_direct_path_raises_in_the_stream_task() -> None:
    """What a filter raises in the connection's callback is raised where the pump task
    would have raised it: the stream's handler, not the HTTP parser (which would call it
    D's broken body)."""
    seen: dict[str, Any] = {}
    flt = Counting(raise_at=4)
    with (serve(engine(30, 10, 0.01)) as durl,
          serve(one_leg_app(durl, flt, None, seen)) as url,
          pytest.raises(httpx.HTTPError),  # uvicorn drops a response its app broke
          httpx.stream("POST", url, json={}, timeout=10, trust_env=False) as r):
        r.read()
    assert seen["raised"] == ["filter bug"] and seen["direct"] >= 2
