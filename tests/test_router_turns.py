"""Per-turn routes (D-local, P + reuse) and conversations recognised by content, over real
HTTP: the router against a FAKE prefill engine and FAKE decode engines whose leases are
granted by a real LeaseKeeper behind the real lease-control channel (ZMQ on loopback).
Real engines: tests/test_e2e_turns.py."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from helpers_http import OPERATOR, FakeEngine, free_port, serve

from kvferry.connectors.protocol.lease import LeaseError
from kvferry.connectors.protocol.params import SECRET_ENV
from kvferry.connectors.scheduling.lease_keeper import LeaseKeeper
from kvferry.connectors.transfer.lease_control import ControlServer
from kvferry.router.api.app import create_app
from kvferry.router.conversations.history import CONTENT_KEY_PREFIX
from kvferry.router.conversations.registry import ANONYMOUS
from kvferry.router.settings import RouterSettings

KEY = b"turns-secret"
BS = 16
P_PARAMS = {"do_remote_prefill": True, "remote_block_ids": [3], "remote_engine_id": "p0",
            "remote_host": "127.0.0.1", "remote_port": 1}
SYS = {"role": "system", "content": "You answer briefly."}


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, KEY.decode())


class Decoder:
    """A FAKE decode engine: answers chat (JSON or SSE, no params in the stream, as vLLM
    0.32) with "answer N"; leases each request's 'tokens' (4 chars each) with a real keeper."""

    def __init__(self, name: str) -> None:
        self.keeper = LeaseKeeper(f"{name}-engine", "boot-1", "127.0.0.1", 5800, BS, ttl=100.0,
                                  free_grace=0.0)
        self.control_port = free_port()
        self.server = ControlServer(self.keeper, "127.0.0.1", self.control_port)
        self.received: list[dict[str, Any]] = []
        self.status = 200
        self.hold = threading.Event()  # a body with "hold": stream until set
        self._n = 0

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            body = await request.json()
            self.received.append(body)
            if self.status != 200:
                return JSONResponse({"error": {"message": "down"}}, status_code=self.status)
            self._n += 1
            text = f"answer {self._n}"
            chars = sum(len(m.get("content") or "") for m in body["messages"]) + len(text)
            tokens = list(range(max(1, chars // 4)))
            lease = (body.get("kv_transfer_params") or {}).get("lease")
            offer = None
            if lease is not None:
                offer = self.keeper.grant(f"req-{self._n}", lease, list(range(len(tokens) // BS)),
                                          tokens, len(tokens))
            if body.get("stream"):
                return StreamingResponse(self._sse(text, body.get("hold")),
                                         media_type="text/event-stream")
            return {"id": "d", "object": "chat.completion", "model": "tiny",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": len(tokens) - 2, "completion_tokens": 2},
                    "kv_transfer_params": {"lease": offer} if offer else None}

        @app.get("/health")
        async def health() -> Any:
            return {}

        return app

    async def _sse(self, text: str, hold: bool) -> AsyncIterator[bytes]:
        for word in text.split(" "):
            chunk = {"choices": [{"index": 0, "delta": {"content": word + " "}}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        while hold and not self.hold.is_set():
            await asyncio.sleep(0.02)
        yield b"data: [DONE]\n\n"

    def reason(self, lease_id: str) -> str | None:
        try:
            self.keeper.info(lease_id)
        except LeaseError as e:
            return e.reason
        return None

    def lease_only(self, i: int = -1) -> bool:
        """The request was a plain local one: kv_transfer_params asks for a lease only."""
        return set(self.received[i].get("kv_transfer_params") or {}) == {"lease"}


class Stack:
    def __init__(self, es: ExitStack, n_decoders: int = 1, **kw: Any) -> None:
        self.p = FakeEngine("p0", kv_params=dict(P_PARAMS))
        self.ds = [Decoder(f"d{i}") for i in range(n_decoders)]
        for d in self.ds:
            es.callback(d.server.close)
        purl = es.enter_context(serve(self.p.app()))
        durls = [es.enter_context(serve(d.app())) for d in self.ds]
        settings = RouterSettings(prefill_urls=[purl], decode_urls=durls, health_interval_s=0,
                                  decode_control_addrs=[f"127.0.0.1:{d.control_port}"
                                                        for d in self.ds], **kw)
        self.app = create_app(settings, KEY)
        self.url = es.enter_context(serve(self.app))
        self.d = self.ds[0]

    def chat(self, messages: list[dict], key: str | None = None, stream: bool = False,
             headers: dict[str, str] | None = None, **extra: Any) -> tuple[str, httpx.Headers]:
        """One turn; the assistant's text (as a client reads it) and the answer's headers."""
        body = {"model": "tiny", "messages": messages, "stream": stream, **extra}
        h = {**OPERATOR, **({"authorization": f"Bearer {key}"} if key else {}),
             **(headers or {})}
        if not stream:
            r = httpx.post(self.url + "/v1/chat/completions", json=body, headers=h, timeout=10)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"], r.headers
        text = ""
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, headers=h,
                          timeout=10) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for ch in json.loads(line[6:])["choices"]:
                        text += ch.get("delta", {}).get("content") or ""
            return text, r.headers

    def metric(self, name: str, **labels: str) -> float:
        v = self.app.state.metrics.registry.get_sample_value(name, labels or None)
        return v or 0.0

    def routes(self) -> dict[str, float]:
        return {r: self.metric("kvferry_router_turn_routes_total", route=r, reason=why)
                for r, why in (("d_local", "short_turn"), ("p_cold", "no_history"))}

    def entry(self, cid: str, tenant: str = ANONYMOUS):
        return self.app.state.conversations.registry.get(tenant, cid, time.time())

    def content_entries(self) -> list:
        reg = self.app.state.conversations.registry
        return [reg.get(t, k, time.time()) for (t, k) in reg.held()
                if k.startswith(CONTENT_KEY_PREFIX)]


@pytest.fixture
def es() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


def wait_for(cond: Callable[[], bool], timeout: float = 5.0, what: str = "") -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def test_short_turn_is_served_by_its_decoder_and_keeps_the_conversation(es: ExitStack):
    s = Stack(es)
    msgs = [SYS, user("q" * 400)]
    a1, h1 = s.chat(msgs, conversation_id="c")
    assert len(s.p.received) == 1 and h1.get("x-kvferry-route") is None
    lease1 = s.entry("c").lease_id
    msgs += [assistant(a1), user("short follow-up")]
    a2, h2 = s.chat(msgs, conversation_id="c")
    assert h2["x-kvferry-route"] == "d_local" and "x-kvferry-prefill" not in h2
    assert len(s.p.received) == 1, "P got nothing for the short turn"
    assert s.d.lease_only() and s.d.received[-1]["messages"] == msgs
    # The turn's own lease replaced the old one, which D was told to release.
    e2 = s.entry("c")
    assert e2.lease_id != lease1 and s.d.reason(e2.lease_id) is None
    wait_for(lambda: s.d.reason(lease1) == "released", what="the replaced lease released")
    assert e2.history["messages"] == len(msgs) + 1
    assert s.metric("kvferry_router_d_local_new_tokens_total") > 0
    # A long turn (a pasted document) goes to P, offered the D-local turn's lease.
    msgs += [assistant(a2), user("p" * 20_000)]
    _, h3 = s.chat(msgs, conversation_id="c")
    assert h3.get("x-kvferry-route") is None and len(s.p.received) == 2
    assert s.p.received[-1]["kv_transfer_params"]["reuse"]["lease_id"] == e2.lease_id
    assert s.metric("kvferry_router_turn_routes_total", route="p_reuse", reason="long_turn") == 1
    # The client may keep a turn on P.
    msgs += [assistant("x"), user("tiny")]
    _, h4 = s.chat(msgs, conversation_id="c", headers={"x-kvferry-route": "prefill"})
    assert len(s.p.received) == 3
    assert s.metric("kvferry_router_turn_routes_total", route="p_reuse", reason="client_asked") == 1
    assert s.routes() == {"d_local": 1, "p_cold": 1}


def test_edited_history_with_an_id_goes_to_prefill(es: ExitStack):
    s = Stack(es)
    a1, _ = s.chat([SYS, user("q" * 300)], conversation_id="c")
    s.chat([SYS, user("Q" * 300), assistant(a1), user("more")], conversation_id="c")
    assert len(s.p.received) == 2
    assert s.metric("kvferry_router_turn_routes_total", route="p_reuse",
                    reason="history_changed") == 1


def test_busy_decoder_sends_short_turns_to_prefill(es: ExitStack):
    s = Stack(es, d_local_max_in_flight=1)
    a1, _ = s.chat([SYS, user("q" * 300)], conversation_id="c")
    with httpx.Client(timeout=10, headers=OPERATOR) as c, c.stream(
            "POST", s.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": [user("other")], "stream": True, "hold": True}):
        wait_for(lambda: s.app.state.pools["decode"].upstreams[0].in_flight == 1, what="D busy")
        _, h = s.chat([SYS, user("q" * 300), assistant(a1), user("short")], conversation_id="c")
        s.d.hold.set()
    assert h.get("x-kvferry-route") is None and len(s.p.received) == 3
    assert s.metric("kvferry_router_turn_routes_total", route="p_reuse", reason="decoder_busy") == 1


def test_budget_limits_d_local_prefill_on_a_busy_decoder(es: ExitStack):
    s = Stack(es, d_local_busy_tokens_per_s=1.0, d_local_max_new_tokens=200)
    a1, _ = s.chat([SYS, user("q" * 300)], conversation_id="c")
    with httpx.Client(timeout=10, headers=OPERATOR) as c, c.stream(
            "POST", s.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": [user("other")], "stream": True, "hold": True}):
        wait_for(lambda: s.app.state.pools["decode"].upstreams[0].in_flight == 1, what="D busy")
        msgs = [SYS, user("q" * 300), assistant(a1), user("f" * 600)]
        a2, h = s.chat(msgs, conversation_id="c")  # the bucket starts full (200 tokens)
        assert h["x-kvferry-route"] == "d_local"
        _, h = s.chat(msgs + [assistant(a2), user("g" * 600)], conversation_id="c")
        assert h.get("x-kvferry-route") is None  # the bucket is empty: refills at 1 token/s
        s.d.hold.set()
    assert s.metric("kvferry_router_turn_routes_total", route="p_reuse",
                    reason="decoder_budget") == 1


def test_failed_d_local_leg_falls_back_to_prefill(es: ExitStack):
    s = Stack(es, n_decoders=2, eject_after=1)
    a1, h1 = s.chat([SYS, user("q" * 300)], conversation_id="c")
    home = next(d for d, u in zip(s.ds, s.app.state.settings.decode_urls, strict=True)
                if u == h1["x-kvferry-decode"])
    other = next(d for d in s.ds if d is not home)
    home.status = 500
    text, h = s.chat([SYS, user("q" * 300), assistant(a1), user("short")], conversation_id="c")
    assert text.startswith("answer") and h["x-kvferry-decode"] != h1["x-kvferry-decode"]
    assert len(s.p.received) == 2 and other.received
    assert s.metric("kvferry_router_retries_total", leg="decode", mode="d_local") == 1


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_client_without_ids_is_recognised_by_content(es: ExitStack, stream: bool):
    s = Stack(es)
    h1_msgs = [SYS, user("q" * 300)]
    a1, _ = s.chat(h1_msgs, stream=stream)
    assert s.metric("kvferry_router_content_matches_total", result="miss") == 1
    wait_for(lambda: len(s.content_entries()) == 1, what="turn 1 recorded under its content")
    msgs = h1_msgs + [assistant(a1), user("short")]
    a2, h2 = s.chat(msgs, stream=stream)
    assert h2["x-kvferry-route"] == "d_local" and len(s.p.received) == 1
    assert s.metric("kvferry_router_content_matches_total", result="hit") == 1
    # Turn 1's entry retired, turn 2's recorded (a stream's commit may still be on its way:
    # the next turn waits for it, this check does too).
    wait_for(lambda: [e.history["messages"] for e in s.content_entries()] == [len(msgs) + 1],
             what="turn 2 recorded in place of turn 1")
    # Turn 3 continues turn 2 (its digest includes answer 2 as the client received it).
    msgs3 = msgs + [assistant(a2), user("again")]
    _, h3 = s.chat(msgs3, stream=stream)
    assert h3["x-kvferry-route"] == "d_local" and len(s.p.received) == 1
    assert s.metric("kvferry_router_content_matches_total", result="hit") == 2
    # Edited history, another tenant, a regenerated answer: no match, P without history.
    for body, key in ((msgs3[:1] + [user("Q" * 300)] + msgs3[2:], None),
                      (msgs3, "someone-else"),
                      (msgs[:2] + [assistant("answer 99"), user("short")], None)):
        before = len(s.p.received)
        _, h = s.chat(body, key=key, stream=stream)
        assert h.get("x-kvferry-route") is None and len(s.p.received) == before + 1
        assert s.p.received[-1]["kv_transfer_params"].get("reuse") is None
    assert s.metric("kvferry_router_content_matches_total", result="hit") == 2
    # An explicit id wins over content: a new id has no history, whatever the content.
    _, h = s.chat(msgs3 + [assistant("answer 3"), user("x")], conversation_id="fresh")
    assert h.get("x-kvferry-route") is None
    assert s.metric("kvferry_router_turn_routes_total", route="p_cold", reason="no_history") >= 1


def test_same_content_from_two_tenants_keeps_two_entries(es: ExitStack):
    s = Stack(es)
    for key in ("alice", "bob"):
        a1, _ = s.chat([SYS, user("q" * 300)], key=key)
        _, h = s.chat([SYS, user("q" * 300), assistant(a1), user("hi")], key=key)
        assert h["x-kvferry-route"] == "d_local"
    tenants = {t for (t, k) in s.app.state.conversations.registry.held()
               if k.startswith(CONTENT_KEY_PREFIX)}
    assert len(tenants) == 2 and ANONYMOUS not in tenants


def test_content_reuse_can_be_turned_off_and_skips_unfollowable_requests(es: ExitStack):
    s = Stack(es, content_reuse=False)
    a1, _ = s.chat([SYS, user("q" * 300)])
    s.chat([SYS, user("q" * 300), assistant(a1), user("hi")])
    assert len(s.p.received) == 2 and not s.content_entries()
    assert not any("lease" in (b.get("kv_transfer_params") or {}) for b in s.d.received)
    s2 = Stack(es)
    s2.chat([SYS, user("q" * 300)], n=2)  # two answers: which one continues is unknowable
    assert not s2.content_entries()
    assert not any("lease" in (b.get("kv_transfer_params") or {}) for b in s2.d.received)


def test_logs_are_text_for_content_keyed_conversations(es: ExitStack,
                                                       caplog: pytest.LogCaptureFixture):
    """Issue 37 item 8: a conversation recognised by its content is keyed by a NUL-led
    digest; what the router logs of it is text (router.log stays greppable)."""
    s = Stack(es)
    s.d.keeper.grant = lambda *a, **k: None  # D grants no lease: the router logs why not
    caplog.set_level(logging.INFO, logger="kvferry.router")
    s.chat([SYS, user("q" * 300)])
    wait_for(lambda: any("no lease" in r.getMessage() for r in caplog.records),
             what="the missing lease logged")
    assert all(r.getMessage().isprintable() for r in caplog.records)
