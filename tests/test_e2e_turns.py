"""Per-turn routes on real vLLM CPU engines (1 P + 1 D behind the router).

A short follow-up turn goes to the conversation's D alone, which serves it from its own
prefix cache (the lease keeps the blocks there): the router counts it ``d_local``, D's
prefix-cache hits grow by the leased history, and P receives nothing. A long turn goes to
P, which reads the history back from D (P runs without prefix caching, as if it had
evicted it). After a D-local turn the conversation's entry holds a new lease on D, the old
one is released, and the next turn still finds the history. Every turn's greedy output
equals a colocated run (P's engine alone).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from helpers_http import OPERATOR, serve
from shared_stacks import PairConfig, shared
from stack import (
    ROUTERS,
    Stack,
    assert_no_engine_fields,
    assert_same_output,
    complete,
    kvferry_router_settings,
    prompt,
    wait_until,
)

from kvferry.router.api.app import create_app
from kvferry.router.conversations import lease_control
from kvferry.router.conversations.history import CONTENT_KEY_PREFIX
from kvferry.router.conversations.registry import ANONYMOUS

pytestmark = [pytest.mark.engine, pytest.mark.shared_stack("reuse")]

BS = 128  # CPU engines' block size
EXTRA = {"handshake_timeout_s": 3, "lease_free_grace_s": 2.0, "lease_margin_s": 1.5,
         "reuse_read_timeout_s": 1.0}
MAX_NEW = 256  # D-local up to two CPU blocks of new tokens


@dataclass
class Routed:
    stack: Stack
    app: FastAPI
    url: str

    def routes(self, route: str) -> float:
        reg = self.app.state.metrics.registry
        return sum(s.value for fam in reg.collect() for s in fam.samples
                   if s.name == "kvferry_router_turn_routes_total" and s.labels["route"] == route)

    def metric(self, name: str, **labels: str) -> float:
        return self.app.state.metrics.registry.get_sample_value(name, labels or None) or 0.0

    def entry(self, cid: str) -> Any:
        return self.app.state.conversations.registry.get(ANONYMOUS, cid, time.time())

    def lease_state(self, lease_id: str) -> str:
        """D's word on a lease: "held", or why not (released, unknown, expired)."""
        reply = asyncio.run(lease_control.call(("127.0.0.1", self.stack.decode.control_port),
                                               "info", lease_id,
                                               key=self.stack.secret.encode()))
        return "held" if reply.get("ok") else str(reply.get("error"))


@pytest.fixture(scope="module")
def routed(tmp_path_factory) -> Iterator[Routed]:
    # test_e2e_reuse.py's engines, handed over at baseline (shared_stacks.py).
    s = shared("reuse", PairConfig(EXTRA, ("--no-enable-prefix-caching",)), tmp_path_factory)
    with ExitStack() as es:
        settings = kvferry_router_settings([s.prefill], [s.decode], prefill_timeout_s=120,
                                           decode_timeout_s=120, d_local_max_new_tokens=MAX_NEW)
        app = create_app(settings, s.secret.encode())
        url = es.enter_context(serve(app))
        ROUTERS.add(url)
        yield Routed(s, app, url)


def out_tokens(resp: dict) -> list[int]:
    return list(resp["choices"][0]["token_ids"])


def turn(r: Routed, toks: list[int], cid: str) -> tuple[dict, httpx.Headers]:
    body = {"model": r.stack.model, "prompt": toks, "max_tokens": 12, "temperature": 0,
            "logprobs": 5, "return_token_ids": True, "conversation_id": cid}
    resp = httpx.post(r.url + "/v1/completions", json=body, timeout=180, headers=OPERATOR)
    resp.raise_for_status()
    assert_no_engine_fields(resp.text)
    return resp.json(), resp.headers


def held(prev_prompt: list[int], prev_out: list[int], new_prompt: list[int]) -> int:
    """Full blocks of D's KV (prompt + all but the last generated token) that the new
    prompt starts with, never its last token."""
    hist = prev_prompt + prev_out[:-1]
    same = 0
    while same < min(len(hist), len(new_prompt)) and hist[same] == new_prompt[same]:
        same += 1
    return min(same, len(hist) // BS * BS, len(new_prompt) - 1) // BS * BS


def p_requests(r: Routed) -> float:
    return r.stack.prefill.metric("vllm:request_success_total")


def d_hits(r: Routed) -> float:
    return r.stack.decode.metric("vllm:prefix_cache_hits_total")


def test_short_turns_go_d_local_long_ones_through_p(routed: Routed):
    r, s = routed, routed.stack
    t1 = prompt(300, 1)
    want1 = complete(s.prefill.url, s.model, t1)
    r1, h1 = turn(r, t1, "conv-1")
    assert "x-kvferry-prefill" in h1 and r.routes("p_cold") == 1
    assert_same_output(r1, want1)
    lease1 = r.entry("conv-1").lease_id

    # Turn 2: 40 new tokens on a 312-token history: D alone, from its prefix cache.
    t2 = t1 + out_tokens(r1) + prompt(40, 2)
    p0, hits0 = p_requests(r), d_hits(r)
    r2, h2 = turn(r, t2, "conv-1")
    assert h2["x-kvferry-route"] == "d_local" and "x-kvferry-prefill" not in h2
    assert r.routes("d_local") == 1
    assert p_requests(r) == p0, "P received a request for a D-local turn"
    assert d_hits(r) - hits0 == held(t1, out_tokens(r1), t2) == 2 * BS
    assert_same_output(r2, complete(s.prefill.url, s.model, t2))
    # The D-local turn holds its own lease; the one it replaced is released on D.
    e2 = r.entry("conv-1")
    assert e2.lease_id != lease1 and r.lease_state(e2.lease_id) == "held"
    wait_until(lambda: r.lease_state(lease1) != "held", 10, "turn 1's lease released")
    got = httpx.get(r.url + "/v1/kvferry/conversations/conv-1", timeout=10).json()
    assert got["cached_tokens"] == (len(t2) + 11) // BS * BS  # prompt + all but the last token

    # Turn 3: 600 new tokens: P, reading turn 2's history back from D.
    t3 = t2 + out_tokens(r2) + prompt(600, 3)
    r3, h3 = turn(r, t3, "conv-1")
    assert "x-kvferry-route" not in h3 and r.routes("p_reuse") == 1
    assert int(h3["x-kvferry-reused-tokens"]) == held(t2, out_tokens(r2), t3) > 0
    assert h3["x-kvferry-reuse-reason"] == "ok"
    assert_same_output(r3, complete(s.prefill.url, s.model, t3))

    # Turn 4: short again, after a P turn: D-local on the lease turn 3's D leg made.
    t4 = t3 + out_tokens(r3) + prompt(20, 4)
    p0, hits0 = p_requests(r), d_hits(r)
    r4, h4 = turn(r, t4, "conv-1")
    assert h4["x-kvferry-route"] == "d_local" and p_requests(r) == p0
    assert d_hits(r) - hits0 == held(t3, out_tokens(r3), t4) > 0
    assert_same_output(r4, complete(s.prefill.url, s.model, t4))
    assert r.routes("d_local") == 2


def test_chat_turns_are_counted_from_their_text(routed: Routed):
    r, s = routed, routed.stack
    msgs = [{"role": "system", "content": "You are a ferry dispatcher. " * 30},
            {"role": "user", "content": "Which boats leave at noon?"}]
    body = {"model": s.model, "max_tokens": 12, "temperature": 0, "conversation_id": "conv-chat"}

    def ask(messages: list[dict]) -> tuple[str, httpx.Headers, str]:
        got = httpx.post(r.url + "/v1/chat/completions", json={**body, "messages": messages},
                         timeout=180)
        got.raise_for_status()
        want = httpx.post(s.prefill.url + "/v1/chat/completions", timeout=180,
                          json={k: v for k, v in {**body, "messages": messages}.items()
                                if k != "conversation_id"}).json()
        return (got.json()["choices"][0]["message"]["content"], got.headers,
                want["choices"][0]["message"]["content"])

    a1, h1, want1 = ask(msgs)
    assert a1 == want1 and "x-kvferry-route" not in h1
    msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": "And at one?"}]
    hits0 = d_hits(r)
    a2, h2, want2 = ask(msgs)
    assert h2["x-kvferry-route"] == "d_local" and a2 == want2
    assert d_hits(r) - hits0 >= BS
    msgs += [{"role": "assistant", "content": a2},
             {"role": "user", "content": "Here is the full timetable: " + "boat leaves " * 150}]
    a3, h3, want3 = ask(msgs)
    assert "x-kvferry-route" not in h3 and int(h3["x-kvferry-reused-tokens"]) > 0 and a3 == want3


# -- conversations without ids: a plain OpenAI SDK client ---------------------------------
def test_openai_sdk_client_without_ids_gets_reuse(routed: Routed):
    """The SDK resends its history (here the answer objects themselves, with the SDK's own
    extra fields); the router recognises the conversation by content, within the tenant."""
    from openai import OpenAI

    r, s = routed, routed.stack
    sdk = OpenAI(base_url=r.url + "/v1", api_key="tenant-a", max_retries=0, timeout=180)
    other = OpenAI(base_url=r.url + "/v1", api_key="tenant-b", max_retries=0, timeout=180)
    reused0 = r.metric("kvferry_router_reused_tokens_total")

    def ask(client: Any, messages: list[Any], **kw: Any) -> tuple[Any, httpx.Headers]:
        raw = client.chat.completions.with_raw_response.create(
            model=s.model, messages=messages, max_tokens=12, temperature=0, **kw)
        msg = raw.parse().choices[0].message
        want = colocated(s, messages)
        assert msg.content == want, "routed answer differs from the colocated run"
        return msg, raw.headers

    msgs: list[Any] = [{"role": "system", "content": "You plan ferry crossings. " * 30},
                       {"role": "user", "content": "Plan a crossing for ten crates."}]
    a1, h1 = ask(sdk, msgs)
    assert "x-kvferry-route" not in h1
    msgs += [a1, {"role": "user", "content": "Make it eight crates."}]
    p0, hits0 = p_requests(r), d_hits(r)
    a2, h2 = ask(sdk, msgs)
    assert h2["x-kvferry-route"] == "d_local" and d_hits(r) - hits0 >= 2 * BS
    assert p_requests(r) == p0 + 1  # the colocated run only
    # Another tenant sending the very same messages: no match, P without history.
    _, hb = ask(other, msgs)
    assert "x-kvferry-route" not in hb and "x-kvferry-reused-tokens" not in hb
    # A long turn (a pasted manifest): P, reading the history back from D.
    msgs += [a2, {"role": "user", "content": "Manifest: " + "crate of apples, " * 120}]
    a3, h3 = ask(sdk, msgs)
    n3 = int(h3["x-kvferry-reused-tokens"])
    assert n3 > 0 and r.metric("kvferry_router_reused_tokens_total") - reused0 == n3
    # A streamed short turn continues it (the answer as the stream delivered it).
    msgs += [a3, {"role": "user", "content": "Thanks!"}]
    with sdk.chat.completions.with_streaming_response.create(
            model=s.model, messages=msgs, max_tokens=12, temperature=0, stream=True) as resp:
        assert resp.headers["x-kvferry-route"] == "d_local"
        text = "".join(c.choices[0].delta.content or "" for c in resp.parse() if c.choices)
    assert text == colocated(s, msgs)
    # Edited (the first question rewritten) and forked (turn 2 answered differently by the
    # client) histories match nothing: P without history, the right answer all the same.
    edited = [msgs[0], {"role": "user", "content": "Plan a crossing for nine crates."}, *msgs[2:]]
    forked = [*msgs[:3], {"role": "user", "content": "Make it twelve crates."}]
    for hist in (edited, forked):
        _, h = ask(sdk, hist)
        assert "x-kvferry-route" not in h and "x-kvferry-reused-tokens" not in h
    assert r.metric("kvferry_router_content_matches_total", result="hit") == 3


def colocated(s: Stack, messages: list[Any]) -> str:
    """P's engine alone (no prefix caching) answering the same messages."""
    plain = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]
    got = httpx.post(s.prefill.url + "/v1/chat/completions", timeout=180, json={
        "model": s.model, "messages": plain, "max_tokens": 12, "temperature": 0})
    got.raise_for_status()
    return got.json()["choices"][0]["message"]["content"]


def test_released_conversations_leave_no_block_held(routed: Routed):
    for cid in ("conv-1", "conv-chat"):
        httpx.delete(routed.url + f"/v1/kvferry/conversations/{cid}", timeout=10)
    # Content-keyed ones (no id to end them by) are released by the registry on the
    # router's side, as expiry or eviction would.
    conv = routed.app.state.conversations
    for (tenant, key) in conv.registry.held():
        if key.startswith(CONTENT_KEY_PREFIX):
            entry = conv.registry.drop(tenant, key)
            asyncio.run(lease_control.call(("127.0.0.1", routed.stack.decode.control_port),
                                           "release", entry.lease_id,
                                           key=routed.stack.secret.encode()))
    wait_until(lambda: routed.stack.decode.kv_usage() == 0, 30, "D to free every leased block")
    wait_until(lambda: routed.stack.prefill.kv_usage() == 0, 30, "P to free every block")
