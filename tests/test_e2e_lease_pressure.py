"""Leases under memory pressure on real vLLM CPU engines, through the router (issue 17).

D has a small KV cache (40 blocks of 128 tokens). Three conversations leave their turns'
blocks under leases; then a request without a conversation needs more blocks than are
free. No vLLM version asks a connector when a new request waits for blocks, so D reads
its Scheduler's free blocks and waiting queue each step (`compat.kv_pressure`) and
releases least recently used leases, only as many as the request needs. Without that the
request would wait until a lease's TTL (here 480 s). Every answer must equal a colocated
run; the conversations whose leases went recompute, the one whose lease stayed reuses.
"""

from __future__ import annotations

import time

import httpx
import pytest
from helpers_reuse import BS, expected_reuse, out_tokens, reused_of
from stack import assert_no_engine_fields, assert_same_output, complete, prompt

pytestmark = pytest.mark.engine

D_BLOCKS = 40  # 5120 tokens: above the engines' max model len (4096), as vLLM requires
EXTRA = {"handshake_timeout_s": 3, "lease_free_grace_s": 1.0, "lease_margin_s": 0.8,
         "reuse_read_timeout_s": 0.5, "lease_max_fraction": 0.9}
P_ONLY = {"d_local_max_new_tokens": 0}  # turns take P with D -> P reuse
FIRST = 1100  # each turn 1: 1112 tokens with the answer, 8 full blocks leased
BIG = 3000  # 24 blocks: more than the 12 left free by three turns (9 blocks each)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from stack import pd_stack, tiny_model

    model = tiny_model(tmp_path_factory)
    with pd_stack(model, tmp_path_factory.mktemp("logs"), extra=EXTRA,
                  prefill_args=("--no-enable-prefix-caching",),
                  decode_args=("--num-gpu-blocks-override", str(D_BLOCKS)),
                  router=P_ONLY) as s:
        yield s


def turn(url: str, model: str, toks: list[int], cid: str | None, timeout: float = 180
         ) -> tuple[dict, httpx.Headers]:
    body = {"model": model, "prompt": toks, "max_tokens": 12, "temperature": 0,
            "logprobs": 5, "return_token_ids": True}
    if cid is not None:
        body["conversation_id"] = cid
    r = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
    r.raise_for_status()
    assert_no_engine_fields(r.text)
    return r.json(), r.headers


def test_leases_yield_to_a_request_that_needs_their_blocks(stack):
    held = 3 * -(-(FIRST + 12) // BS)  # each finished turn keeps all its blocks (delayed free)
    assert D_BLOCKS - 1 - held < -(-BIG // BS) <= D_BLOCKS - 1 - held + 2 * (FIRST + 12) // BS
    firsts = {}
    for i, cid in enumerate(("old", "mid", "new")):  # granted in this order: LRU first
        toks = prompt(FIRST, 300 + i)
        resp, _ = turn(stack.router, stack.model, toks, cid)
        assert_same_output(resp, complete(stack.prefill.url, stack.model, toks))
        firsts[cid] = (toks, resp)
    big = prompt(BIG, 399)
    t0 = time.monotonic()
    resp, _ = turn(stack.router, stack.model, big, None, timeout=60)  # a lease's TTL: 480 s
    waited = time.monotonic() - t0
    assert_same_output(resp, complete(stack.prefill.url, stack.model, big))
    assert waited < 30, f"the request waited {waited:.1f}s for D's blocks"
    # 12 free + 8 (old) < 24, + 8 (mid) >= 24: old and mid yielded, new kept its blocks.
    # The router still holds all three offers: P asks D before each READ and recomputes
    # the two whose leases ended (reading them would give a wrong answer: D has given
    # those blocks to the big request).
    for cid, reused in (("old", False), ("mid", False), ("new", True)):
        toks, first = firsts[cid]
        nxt = toks + out_tokens(first) + prompt(100, 310)
        p0 = stack.prefill.stats()
        got, headers = turn(stack.router, stack.model, nxt, cid)
        assert_same_output(got, complete(stack.prefill.url, stack.model, nxt))
        want = expected_reuse(toks, out_tokens(first), nxt) if reused else 0
        assert reused_of(headers) == want, (cid, headers)
        p1 = stack.prefill.stats()
        refused = [e.detail for e in p1.since(p0) if e.name == "reuse_reads_failed"]
        if reused:
            assert refused == [] and p1["reuse_reads_done"] == p0["reuse_reads_done"] + 1
        else:
            assert refused == ["not started: lease ended on D: released"], refused
            assert p1["reuse_reads_done"] == p0["reuse_reads_done"]
    for cid in firsts:
        httpx.delete(f"{stack.router}/v1/kvferry/conversations/{cid}", timeout=10)
    # Nothing leaked: with the conversations gone, every one of D's blocks comes free
    # (at once, or a grace after P's last check of a lease: 1 s here).
    deadline = time.monotonic() + 10
    while (used := stack.decode.kv_usage()) > 0:
        assert time.monotonic() < deadline, f"D's KV cache still {used:.1%} used"
        time.sleep(0.2)
