"""Bidirectional reuse end to end on real vLLM CPU engines, through the router.

Multi-turn conversations: after each turn D keeps the turn's blocks under a lease; on the
next turn P (prefix caching off, as if it had evicted the history) READs them back from
D instead of recomputing, then the new turn's KV goes to D by pull or push. Every turn's
greedy output must equal a colocated run, and the reused token counts are asserted.
"""

from __future__ import annotations

import time
import uuid
from contextlib import ExitStack

import httpx
import pytest
from helpers_http import serve
from helpers_reuse import BS, expected_reuse, out_tokens, reused_of
from shared_stacks import PairConfig, shared
from stack import (
    assert_no_engine_fields,
    assert_same_output,
    complete,
    outputs_differ,
    prompt,
    settled_writes,
    wait_until,
    with_router,
)

from kvferry.router.api.app import create_app
from kvferry.router.settings import RouterSettings

pytestmark = [pytest.mark.engine, pytest.mark.shared_stack("reuse")]

EXTRA = {"handshake_timeout_s": 3, "lease_free_grace_s": 2.0, "lease_margin_s": 1.5,
         "reuse_read_timeout_s": 1.0}

# Turns go through P so that they exercise D -> P reuse: the router's per-turn policy would
# serve these short follow-ups on D from its own prefix cache (tests/test_e2e_turns.py).
P_ONLY = {"d_local_max_new_tokens": 0}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # The engines test_e2e_turns.py uses next (shared_stacks.py); this module's router.
    s = shared("reuse", PairConfig(EXTRA, ("--no-enable-prefix-caching",)), tmp_path_factory)
    with ExitStack() as es:
        yield with_router(es, s, P_ONLY)


def turn(url: str, model: str, toks: list[int], cid: str | None, key: str | None = None,
         mode: str = "pull", max_tokens: int = 12) -> tuple[dict, httpx.Headers]:
    body = {"model": model, "prompt": toks, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 5, "return_token_ids": True}
    if cid is not None:
        body["conversation_id"] = cid
    headers = {"x-kvferry-mode": mode}
    if key:
        headers["authorization"] = f"Bearer {key}"
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=180)
    r.raise_for_status()
    assert_no_engine_fields(r.text)
    return r.json(), r.headers


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def converse(stack, cid: str, turns: int = 3, seed: int = 0, first: int = 300, mode: str = "pull"):
    """Run `turns` turns; check each against colocated; return [(prompt, resp, headers)]."""
    out = []
    toks = prompt(first, seed)
    for i in range(turns):
        if out:
            prev_toks, prev_resp, _ = out[-1]
            toks = prev_toks + out_tokens(prev_resp) + prompt(150, seed * 100 + i)
        resp, headers = turn(stack.router, stack.model, toks, cid, mode=mode)
        assert_same_output(resp, complete(stack.prefill.url, stack.model, toks))
        out.append((toks, resp, headers))
    return out


def test_turns_reuse_decode_kv(stack):
    p_ext, p0 = stack.prefill.transferred_tokens(), stack.prefill.stats()
    hist = converse(stack, "conv-pull", turns=3, seed=1)
    assert reused_of(hist[0][2]) == 0
    total = 0
    for (pt, pr, _), (nt, _, nh) in zip(hist, hist[1:], strict=False):
        want = expected_reuse(pt, out_tokens(pr), nt)
        assert want >= 2 * BS
        assert reused_of(nh) == want, f"reused {reused_of(nh)} tokens, expected {want}"
        assert nh["x-kvferry-reuse-reason"] == "ok"
        total += want
    # P's own accounting agrees: those tokens came from an external KV transfer.
    assert stack.prefill.transferred_tokens() - p_ext == total
    p1 = stack.prefill.stats()  # P counts a reuse READ before it computes the rest
    assert p1["reuse_reads_done"] - p0["reuse_reads_done"] == 2, "one READ per later turn"
    assert p1["reuse_reads_failed"] == p0["reuse_reads_failed"]
    r = httpx.get(stack.router + "/v1/kvferry/conversations/conv-pull", timeout=10).json()
    assert r["cached_tokens"] % BS == 0 and r["cached_tokens"] >= len(hist[-1][0]) // BS * BS


def test_edited_history_reuses_only_the_matching_prefix(stack):
    hist = converse(stack, "conv-edit", turns=2, seed=2)
    toks, resp, _ = hist[-1]
    edited = list(toks)
    edited[BS + 10] = (edited[BS + 10] + 1) % 900 + 10  # client rewrote something in block 1
    edited += out_tokens(resp) + prompt(100, 77)
    got, headers = turn(stack.router, stack.model, edited, "conv-edit")
    assert reused_of(headers) == BS  # block 0 only
    assert_same_output(got, complete(stack.prefill.url, stack.model, edited))
    # A history with nothing in common: no reuse at all, still the right answer.
    other = prompt(600, 999)
    got, headers = turn(stack.router, stack.model, other, "conv-edit")
    assert reused_of(headers) == 0
    assert_same_output(got, complete(stack.prefill.url, stack.model, other))


def test_other_api_key_never_reuses(stack):
    hist = converse(stack, "conv-tenant", turns=1, seed=3)
    toks, resp, _ = hist[0]
    nxt = toks + out_tokens(resp) + prompt(100, 31)
    got, headers = turn(stack.router, stack.model, nxt, "conv-tenant", key="someone-else")
    assert reused_of(headers) == 0
    assert_same_output(got, complete(stack.prefill.url, stack.model, nxt))
    # ...while the owner (no key here) still reuses its own history.
    got, headers = turn(stack.router, stack.model, nxt, "conv-tenant")
    assert reused_of(headers) == expected_reuse(toks, out_tokens(resp), nxt) > 0


def test_push_and_reuse_together(stack):
    before = metric(stack.router, "kvferry_router_reused_tokens_total")
    p0 = stack.prefill.stats()
    hist = converse(stack, "conv-push", turns=3, seed=4, mode="push")
    want = sum(expected_reuse(pt, out_tokens(pr), nt)
               for (pt, pr, _), (nt, _, _) in zip(hist, hist[1:], strict=False))
    wait_until(lambda: metric(stack.router, "kvferry_router_reused_tokens_total") - before == want,
               20, f"router to count {want} reused tokens")
    assert settled_writes([stack.prefill], p0, 3) == 3, "one push WRITE per turn"
    # Push: the reuse report rides in D's body when P answered first (P's leg runs in
    # the background, so it may also come after D's answer).
    for _, resp, _ in hist[1:]:
        if "kvferry_reuse_reason" in resp:
            assert resp["kvferry_reuse_reason"] == "ok" and resp["kvferry_reused_tokens"] > 0


def test_streamed_turn_is_recorded(stack):
    toks = prompt(400, 5)
    body = {"model": stack.model, "prompt": toks, "max_tokens": 8, "temperature": 0,
            "stream": True, "conversation_id": "conv-stream"}
    with httpx.stream("POST", stack.router + "/v1/completions", json=body, timeout=120) as r:
        text = "".join(r.iter_text())
    assert "[DONE]" in text
    assert_no_engine_fields(text)
    want = complete(stack.prefill.url, stack.model, toks, max_tokens=8)
    nxt = toks + out_tokens(want) + prompt(100, 51)
    got, headers = turn(stack.router, stack.model, nxt, "conv-stream")
    assert reused_of(headers) == expected_reuse(toks, out_tokens(want), nxt) > 0
    assert_same_output(got, complete(stack.prefill.url, stack.model, nxt))


def test_forged_history_changes_the_answer(stack):
    """Negative control: P handed another prompt's leased blocks (hashes forged to match)
    must answer differently, so the equality checks above really see reused KV."""
    from kvferry.connectors.protocol.params import LeaseOffer, parse_lease, sign_lease
    from kvferry.connectors.protocol.prefix import block_hashes

    a, b = prompt(520, 61), prompt(520, 62)
    lid = uuid.uuid4().hex
    complete(stack.decode.url, stack.model, a, kv_transfer_params={"lease": {"lease_id": lid}},
             logprobs=None)
    import asyncio

    from kvferry.router.conversations import lease_control

    got = asyncio.run(lease_control.call(("127.0.0.1", stack.decode.control_port), "info", lid,
                                         key=stack.secret.encode()))
    assert got["ok"], got
    offer = parse_lease(got["offer"], stack.secret.encode())
    forged = LeaseOffer(**{**{f: getattr(offer, f) for f in LeaseOffer.__struct_fields__},
                           "block_hashes": block_hashes(b[:len(offer.block_hashes) * BS], BS)})
    params = {"reuse": sign_lease(forged, stack.secret.encode())}
    wrong = complete(stack.prefill.url, stack.model, b, kv_transfer_params=params)
    assert outputs_differ(wrong, complete(stack.prefill.url, stack.model, b))
    asyncio.run(lease_control.call(("127.0.0.1", stack.decode.control_port), "release", lid,
                                   key=stack.secret.encode()))


def test_heartbeat_expiry_and_release(stack):
    settings = RouterSettings(prefill_urls=[stack.prefill.url], decode_urls=[stack.decode.url],
                              prefill_kv_addrs=[f"127.0.0.1:{stack.prefill.side_port}"],
                              decode_control_addrs=[f"127.0.0.1:{stack.decode.control_port}"],
                              lease_ttl_s=4.0, **P_ONLY)
    with serve(create_app(settings, stack.secret.encode())) as url:
        # Heartbeats keep a short lease alive past its first term.
        t1 = prompt(400, 7)
        r1, _ = turn(url, stack.model, t1, "conv-hb")
        for _ in range(3):
            time.sleep(2.0)
            hb = httpx.post(url + "/v1/kvferry/conversations/conv-hb/heartbeat", timeout=10)
            assert hb.status_code == 200, hb.text
        t2 = t1 + out_tokens(r1) + prompt(100, 71)
        r2, h2 = turn(url, stack.model, t2, "conv-hb")
        assert reused_of(h2) == expected_reuse(t1, out_tokens(r1), t2) > 0
        assert_same_output(r2, complete(stack.prefill.url, stack.model, t2))
        # Without heartbeats it expires: the next turn recomputes, correctly.
        time.sleep(4.5)
        assert httpx.get(url + "/v1/kvferry/conversations/conv-hb", timeout=10).status_code == 404
        t3 = t2 + out_tokens(r2) + prompt(100, 72)
        r3, h3 = turn(url, stack.model, t3, "conv-hb")
        assert reused_of(h3) == 0
        assert_same_output(r3, complete(stack.prefill.url, stack.model, t3))
        # A released conversation: the router forgets it and D frees the blocks.
        assert httpx.delete(url + "/v1/kvferry/conversations/conv-hb", timeout=10).json() == {
            "released": True}
        t4 = t3 + out_tokens(r3) + prompt(100, 73)
        r4, h4 = turn(url, stack.model, t4, "conv-hb")
        assert reused_of(h4) == 0
        assert_same_output(r4, complete(stack.prefill.url, stack.model, t4))
        httpx.delete(url + "/v1/kvferry/conversations/conv-hb", timeout=10)


def test_restarted_decode_is_never_read(stack):
    """D restarts (same engine id and ports, other blocks): the router's entry and the
    lease offer are stale; P must refuse the READ and recompute."""
    from kvferry.scripts.procs import Child, stop_all, wait_healthy

    hist = converse(stack, "conv-restart", turns=1, seed=8)
    toks, resp, _ = hist[0]
    old = stack.decode.child
    stop_all([old])
    new = Child(old.name, old.argv, old.log_path.with_suffix(".2.log"), old.health_url, old.env)
    new.start()
    stack.decode.child = new
    stack.children.append(new)
    wait_healthy([new], 600)
    nxt = toks + out_tokens(resp) + prompt(100, 81)
    p0 = stack.prefill.stats()
    got, headers = turn(stack.router, stack.model, nxt, "conv-restart")
    assert reused_of(headers) == 0
    assert_same_output(got, complete(stack.prefill.url, stack.model, nxt))
    # Refused before any READ (the engine-id or boot-id check, or the old agent is gone);
    # P counts that before it recomputes.
    p1 = stack.prefill.stats()
    assert p1["reuse_reads_done"] == p0["reuse_reads_done"], "P read a restarted D's blocks"
    refused = [e for e in p1.since(p0) if e.name == "reuse_reads_failed"]
    assert len(refused) == 1 and refused[0].detail.startswith("not started"), refused
    assert p1["recomputes"] == p0["recomputes"] + 1


def test_all_blocks_freed_after_release(stack):
    for cid in ("conv-pull", "conv-edit", "conv-push", "conv-stream", "conv-restart"):
        httpx.delete(stack.router + f"/v1/kvferry/conversations/{cid}", timeout=10)
    # conv-tenant: one entry per tenant
    httpx.delete(stack.router + "/v1/kvferry/conversations/conv-tenant", timeout=10)
    httpx.delete(stack.router + "/v1/kvferry/conversations/conv-tenant", timeout=10,
                 headers={"authorization": "Bearer someone-else"})
    assert metric(stack.router, "kvferry_router_conversations") == 0
    wait_until(lambda: stack.decode.kv_usage() == 0, 30, "D to free every leased block")
    wait_until(lambda: stack.prefill.kv_usage() == 0, 30, "P to free every block")
