"""The router's token path (issue 33): overload refused with 429/503 + Retry-After before
any engine work (router/api/admission.py), and the bytes-level fast path of the stream
rewriter (router/wire/resume.py) giving exactly what the parsing path gives. Real HTTP with
fake engines (tests/helpers_http.py) where a server is involved."""

from __future__ import annotations

import asyncio
import json
import threading
from contextlib import ExitStack
from functools import partial
from typing import Any

import httpx
import pytest
from helpers_http import FakeEngine, serve

from kvferry.router.api.admission import Admission, Refused
from kvferry.router.api.app import create_app
from kvferry.router.settings import RouterSettings
from kvferry.router.wire.resume import EventRewriter
from kvferry.router.wire.resume_request import Progress
from kvferry.router.wire.sse_filters import ChainedFilter, EngineFieldFilter
from kvferry.router.wire.sse_framing import plain_token_ids


def test_admission_queue_bounds_and_hands_slots_over() -> None:
    """One active, one waiting: a third is refused 429 at once; a leaving request hands
    its slot to the waiter; a wait past the timeout is refused 503."""

    async def run() -> list[Any]:
        adm = Admission(max_active=1, max_queued=1, queue_timeout_s=0.3)
        await adm.enter()
        waiter = asyncio.create_task(adm.enter())
        await asyncio.sleep(0.01)
        with pytest.raises(Refused) as full:
            await adm.enter()
        adm.leave()  # the slot goes to the waiter
        await asyncio.wait_for(waiter, 1)
        got = [full.value.status, adm.active, adm.queued]
        with pytest.raises(Refused) as late:
            await adm.enter()  # waits 0.3 s behind the active one
        got += [late.value.status, adm.queued]
        adm.leave()
        got.append(adm.active)
        return got

    assert asyncio.run(run()) == [429, 1, 0, 503, 0, 0]


def test_admission_cancelled_waiter_leaves_no_slot_behind() -> None:
    async def run() -> list[int]:
        adm = Admission(max_active=1, max_queued=4, queue_timeout_s=5)
        await adm.enter()
        waiter = asyncio.create_task(adm.enter())
        await asyncio.sleep(0.01)
        waiter.cancel()  # the client went away while queued
        await asyncio.gather(waiter, return_exceptions=True)
        adm.leave()
        return [adm.active, adm.queued]

    assert asyncio.run(run()) == [0, 0]


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_overload_is_refused_with_retry_after_and_recovers() -> None:
    """A router at capacity (one stream open, no queue) answers 429 + Retry-After without
    touching the engines, counts it, and serves again once the stream ended."""
    p = FakeEngine("P", kv_params={"remote_engine_id": "p"})
    d = FakeEngine("D", chunks=4, chunk_delay_s=0.4)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": True}
    with ExitStack() as stack:
        settings = RouterSettings(prefill_urls=[stack.enter_context(serve(p.app()))],
                                  decode_urls=[stack.enter_context(serve(d.app()))],
                                  max_active=1, max_queued=0, health_interval_s=0)
        url = stack.enter_context(serve(create_app(settings, b"test")))
        first_done = threading.Event()
        first: dict[str, Any] = {}

        def stream_one() -> None:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                first["status"] = r.status_code
                first["body"] = b"".join(r.iter_bytes())
            first_done.set()

        t = threading.Thread(target=stream_one)
        t.start()
        while not d.chunk_sent_at:  # the first stream is open on D
            assert t.is_alive()
            threading.Event().wait(0.01)
        received = len(p.received)
        refused = httpx.post(url + "/v1/completions", json=body, timeout=10)
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_exceeded"
        assert len(p.received) == received  # refused before any engine work
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert _metric(metrics, "kvferry_router_errors_total", kind="queue_full") == 1
        assert first_done.wait(30)
        t.join()
        assert first["status"] == 200 and first["body"].rstrip().endswith(b"data: [DONE]")
        again = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert again.status_code == 200 and b"[DONE]" in again.content


def _event(i: int, *, last: bool = False, role: bool = False, nulls: bool = False) -> bytes:
    """A completions event; `nulls`: as vLLM 0.32 writes them (every event after the first
    carries `"prompt_token_ids":null`: the serving code sets the field on each)."""
    choice: dict[str, Any] = {"index": 0, "text": f" t{i}", "logprobs": None,
                              "finish_reason": "length" if last else None,
                              "stop_reason": None, "token_ids": [100 + i]}
    if role:
        choice["prompt_token_ids"] = [1, 2, 3]
    elif nulls:
        choice["prompt_token_ids"] = None
    obj = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
           "choices": [choice]}
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def test_plain_token_events_are_read_on_their_bytes_with_or_without_null_prompt_ids() -> None:
    for nulls in (False, True):
        assert plain_token_ids(_event(3, nulls=nulls)) is not None
    assert plain_token_ids(_event(0, role=True)) is None  # the prompt's ids: parsed
    two = _event(3, nulls=True).replace(b'"index":0', b'"prompt_token_ids":[7],"index":0')
    assert plain_token_ids(two) is None  # a null key does not hide a real one


@pytest.mark.parametrize("want_ids", [False, True])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("nulls", [False, True])
def test_rewriter_fast_path_matches_parsed_events(want_ids: bool, split: bool, nulls: bool
                                                  ) -> None:
    """Plain token events (handled on their bytes) come out as the parsing path writes
    them: token ids recorded, nulled unless the client asked, nothing else changed; split
    or merged chunks give the same events."""
    events = [_event(0, role=True), *(_event(i, nulls=nulls) for i in range(1, 6)),
              _event(6, last=True, nulls=nulls), b"data: [DONE]\n\n"]
    progress = Progress("completions", want_ids=want_ids)
    rw = EventRewriter(progress)
    raw = b"".join(events)
    chunks = [raw[i:i + 37] for i in range(0, len(raw), 37)] if split else events
    out = b"".join(rw.feed(c) for c in chunks) + rw.flush()
    got = [e for e in out.split(b"\n\n") if e]
    assert got[-1] == b"data: [DONE]"
    objs = [json.loads(e[6:]) for e in got[:-1]]
    assert [o["choices"][0]["text"] for o in objs] == [f" t{i}" for i in range(7)]
    assert [o["choices"][0]["token_ids"] for o in objs] == (
        [[100 + i] for i in range(7)] if want_ids else [None] * 7)
    assert all(o["id"] == "cmpl-1" and o["created"] == 5 for o in objs)
    assert progress.sent == [100 + i for i in range(7)]
    assert progress.prompt_ids == [1, 2, 3]
    assert progress.finished and progress.events == 7 and rw.broken() is None


def test_rewriter_error_event_after_plain_tokens_breaks_the_leg() -> None:
    rw = EventRewriter(Progress("completions", want_ids=False))
    out = rw.feed(_event(0, role=True)) + rw.feed(_event(1))
    out += rw.feed(b'data: {"error":{"message":"boom"}}\n\n') + rw.feed(_event(2))
    assert out.count(b"data: ") == 2  # the error and everything after it are dropped
    assert rw.broken() == "sent an error event: boom"


def test_connect_timeout_counts_only_time_the_router_could_act() -> None:
    """A router whose loop is late (every iteration blocked 0.3 s, as on a starved core)
    still gets its decode leg from an engine that accepted at once: the 0.2 s connect
    timeout is declared only after the loop polled the socket (uvloop: the server's
    loop, which runs expired timers before it polls I/O)."""
    import time

    import uvloop

    from kvferry.router.wire.stream_client import StreamClient

    d = FakeEngine("D", chunks=2)

    async def run(url: str) -> int:
        loop = asyncio.get_running_loop()
        client = StreamClient(8, 4.0)
        blocked = [0]

        def block() -> None:
            time.sleep(0.3)
            blocked[0] += 1
            if blocked[0] < 12:
                loop.call_soon(block)

        try:
            task = asyncio.ensure_future(client.post(
                url + "/v1/completions", json.dumps({"prompt": "hi", "stream": True}).encode(),
                {"content-type": "application/json"}, httpx.Timeout(5.0, connect=0.2)))
            loop.call_soon(block)
            resp = await task
            status = resp.status_code
            body = b"".join([c async for c in resp.aiter_bytes()])
            await resp.aclose()
            assert body.rstrip().endswith(b"data: [DONE]")
            assert blocked[0] >= 2  # the loop was late past the connect deadline
            return status
        finally:
            await client.close()

    with serve(d.app()) as url:
        assert uvloop.run(run(url)) == 200


@pytest.mark.timing
def test_connect_timeout_still_fires_for_an_engine_that_never_accepts() -> None:
    """A listener whose accept queue is full drops new SYNs: with the loop free, the 0.3 s
    connect timeout fires (as a connect timeout: the leg was never sent)."""
    import socket
    import time

    import uvloop

    from kvferry.router.wire.stream_client import StreamClient

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fillers = []
    for _ in range(4):  # fill the accept queue; later SYNs are dropped
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", port))
        fillers.append(c)
    time.sleep(0.1)

    async def run() -> tuple[type, float]:
        client = StreamClient(8, 4.0)
        t0 = time.monotonic()
        try:
            await client.post(f"http://127.0.0.1:{port}/v1/completions", b"{}", {},
                              httpx.Timeout(5.0, connect=0.3))
        except httpx.HTTPError as exc:
            return type(exc), time.monotonic() - t0
        finally:
            await client.close()
        return type(None), time.monotonic() - t0

    try:
        kind, took = uvloop.run(run())
    finally:
        for c in fillers:
            c.close()
        srv.close()
    assert kind is httpx.ConnectTimeout
    assert 0.25 < took < 3.0


def test_plain_token_ids_span_is_the_id_list_in_vllms_shape_and_others() -> None:
    for event in (_event(4), _event(4, nulls=True),
                  _event(4).replace(b'"model":"m"', b'"model":"a\\"b"')):  # an escaped quote
        found = plain_token_ids(event)
        assert found is not None, event
        ids, start, end = found
        assert ids == [104] and event[start:end] == b'"token_ids":[104]'
    chat = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
            b'"choices":[{"index":0,"delta":{"content":"x"},"logprobs":null,'
            b'"finish_reason":null,"token_ids":[9]}]}\n\n')
    assert plain_token_ids(chat) == ([9], chat.index(b'"token_ids"'), chat.index(b"]}]") + 1)
    assert plain_token_ids(_event(4, last=True)) is None  # finish_reason set: parsed


@pytest.mark.parametrize("want_ids", [False, True])
def test_rewriter_then_engine_field_filter_equals_the_two_in_a_chain(want_ids: bool) -> None:
    """`EventRewriter(then=EngineFieldFilter)` (the decode leg's filter) skips the second
    filter for plain token events only: same bytes, params and [DONE] call as chaining
    them, for events with and without engine fields, whole or split."""
    with_null = _event(2, nulls=True).replace(b"]}\n\n", b'],"kv_transfer_params":null}\n\n')
    last = _event(3, last=True).replace(b"]}\n\n", b'],"kv_transfer_params":{"lease":"x"}}\n\n')
    raw = b"".join([_event(0, role=True), _event(1, nulls=True), with_null, last,
                    b"data: [DONE]\n\n"])
    outs = []
    for fused in (True, False):
        for split in (None, 29):
            seen: list = []
            scrub = EngineFieldFilter(seen.append, partial(seen.append, "done"))
            p = Progress("completions", want_ids=want_ids)
            flt = (EventRewriter(p, then=scrub) if fused
                   else ChainedFilter(EventRewriter(p), scrub))
            chunks = [raw[i:i + split] for i in range(0, len(raw), split)] if split else \
                [e + b"\n\n" for e in raw.split(b"\n\n") if e]
            out = b"".join(flt.feed(c) for c in chunks) + flt.flush()
            outs.append((out, seen, p.sent))
    assert all(o == outs[0] for o in outs[1:])
    out, seen, sent = outs[0]
    assert b"kv_transfer_params" not in out and seen == [{"lease": "x"}, "done"]
    assert sent == [100, 101, 102, 103] and out.endswith(b"data: [DONE]\n\n")
