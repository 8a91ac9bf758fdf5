"""Router fleet over real HTTP, shared conversation state: replicas sharing a conversation
in a real Redis, Redis down, slow and back, and both state stores bounded.

Fake engines (tests/helpers_http.py) answer like vLLM; D's lease offers come from a real
D-side LeaseKeeper whose lease-control server the routers call to release leases. Redis is
a real `redis-server` (Debian's package; .ci/setup installs it; tests/fleet_stack.py)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import tracemalloc

import helpers_router_fleet
import httpx
import pytest
from fleet_stack import RedisServer, wait_for
from helpers_fleet import metric, metric_sum, reuse_of
from helpers_router_fleet import router, turn

from kvferry.router.conversations.registry import ConversationEntry, ConversationRegistry
from kvferry.router.conversations.state import RedisState, encode_entry
from kvferry.router.metrics import RouterMetrics

_secret = helpers_router_fleet._secret
redis_server = helpers_router_fleet.redis_server
fresh_redis = helpers_router_fleet.fresh_redis
stack = helpers_router_fleet.stack
pd = helpers_router_fleet.pd


# -- 1. shared conversation state --------------------------------------------------------------
def test_two_replicas_share_a_conversation_through_redis(fresh_redis: RedisServer, pd, stack):
    p, d, purl, durl = pd
    kw = {"prefill_urls": [purl], "decode_urls": [durl], "state": fresh_redis.url,
          "decode_control_addrs": [f"127.0.0.1:{d.control_port}"]}
    (a, app_a), (b, _) = router(stack, **kw), router(stack, **kw)
    assert turn(a).status_code == 200
    assert reuse_of(p) is None  # first turn: nothing to reuse
    with fresh_redis.client() as r:  # written before A answered, with D's lease expiry
        [key] = r.keys("kvferry:conv:*")
        stored = json.loads(r.get(key))
        ttl_ms = r.pttl(key)
    lease1 = stored["lease_id"]
    assert 0 < ttl_ms <= 100_000  # expires with D's lease (ttl 100 s)
    assert stored["decode_url"] == durl and d.reason(lease1) is None

    # Turn 2 on the other replica: P is offered turn 1's KV on D.
    assert turn(b).status_code == 200
    offer = reuse_of(p)
    assert offer is not None and offer["lease_id"] == lease1 and offer["engine_id"] == "d0-engine"
    # B replaced the entry and released the lease it replaced, exactly once, on D.
    wait_for(lambda: d.reason(lease1) == "released", what="turn 1's lease released")
    with fresh_redis.client() as r:
        lease2 = json.loads(r.get(key))["lease_id"]
    assert lease2 != lease1 and d.reason(lease2) is None

    # Turn 3 back on A: offered turn 2's lease (written by B).
    assert turn(a).status_code == 200
    assert reuse_of(p)["lease_id"] == lease2
    # Another tenant never sees it; a failed turn writes nothing.
    httpx.post(a + "/v1/completions", json={"prompt": "x", "conversation_id": "c1"},
               headers={"authorization": "Bearer key-B"}, timeout=10, trust_env=False)
    assert reuse_of(p) is None
    assert metric_sum(app_a, "kvferry_router_state_errors_total") == 0


def test_redis_down_slow_and_back(fresh_redis: RedisServer, pd, stack):
    """Dead or frozen Redis: every turn still answers 200 quickly, without reuse, and the
    errors are counted; once Redis is back, replicas share state again."""
    p, d, purl, durl = pd
    kw = {"prefill_urls": [purl], "decode_urls": [durl], "state": fresh_redis.url,
          "decode_control_addrs": [f"127.0.0.1:{d.control_port}"], "state_retry_s": 0.2}
    (a, app_a), (b, app_b) = router(stack, **kw), router(stack, **kw)
    assert turn(a).status_code == 200 and turn(b).status_code == 200
    assert reuse_of(p) is not None

    fresh_redis.proc.send_signal(signal.SIGSTOP)  # slow: accepts nothing, answers nothing
    try:
        t0 = time.monotonic()
        for _ in range(3):
            assert turn(a).status_code == 200
            assert reuse_of(p) is None
        assert time.monotonic() - t0 < 3.0  # bounded by state_timeout_s, not a hang
    finally:
        fresh_redis.proc.send_signal(signal.SIGCONT)
    assert metric(app_a, "kvferry_router_state_errors_total", op="get", kind="TimeoutError") >= 1
    assert metric(app_a, "kvferry_router_state_up") == 0

    fresh_redis.stop()  # dead: connection refused
    t0 = time.monotonic()
    for url in (a, b, a, b):
        assert turn(url).status_code == 200
        assert reuse_of(p) is None
    assert time.monotonic() - t0 < 3.0
    assert metric_sum(app_b, "kvferry_router_state_errors_total") >= 1
    body = httpx.get(a + "/metrics", trust_env=False).text
    assert "kvferry_router_state_errors_total" in body

    fresh_redis.start()  # empty again (no persistence): sharing resumes by itself

    def shared() -> bool:
        turn(a, "c2")
        turn(b, "c2")
        return reuse_of(p) is not None

    wait_for(shared, 10, "sharing after Redis restart")
    assert metric(app_b, "kvferry_router_state_up") == 1


def test_idle_replica_after_a_redis_restart_reads_on_its_first_call(
        fresh_redis: RedisServer) -> None:
    """A replica that sent nothing while Redis restarted still holds connections the old
    server closed: its first call afterwards must read the entry, not fail on one."""

    async def go() -> None:
        metrics = RouterMetrics()
        state = RedisState(fresh_redis.url, metrics, timeout_s=2.0)
        await asyncio.gather(*(state.get("t", f"c{i}", time.time()) for i in range(8)))
        fresh_redis.stop()
        fresh_redis.start()  # empty: write the entry another replica would have
        with fresh_redis.client() as r:
            r.set(RedisState.key("t", "c1"), encode_entry(_entry(1, time.time() + 60)))
        for i in range(3):  # every pooled connection is stale, not only the first
            entry = await state.get("t", "c1", time.time())
            assert entry is not None and entry.lease_id == f"{1:032x}", i
        assert metrics.registry.get_sample_value("kvferry_router_state_errors_total",
                                                 {"op": "get", "kind": "ConnectionError"}) is None
        await state.close()

    asyncio.run(go())


def _entry(i: int, expiry: float) -> ConversationEntry:
    """A realistic entry: a signed offer over 16 blocks (a ~256-token history)."""
    offer = {"engine_id": "d0-engine", "instance": "boot-1", "host": "10.0.0.7", "port": 5800,
             "lease_id": f"{i:032x}", "block_ids": list(range(i, i + 16)), "block_size": 16,
             "num_tokens": 256, "block_hashes": [f"{i + k:016x}" for k in range(16)],
             "expiry": expiry, "tp_size": 1, "sig": "f" * 64}
    return ConversationEntry("http://d0:8200", "d0-engine", offer["lease_id"], expiry, 256, offer)


def test_memory_state_is_bounded() -> None:
    """100k conversations through a registry bounded at 10k: 10k kept, and they take less
    than 4 KiB each (the stated bound: ~40 MiB for 10k, ~400 MiB at the 100k default)."""
    reg = ConversationRegistry(max_entries=10_000)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    evicted = 0
    for i in range(100_000):
        evicted += len(reg.update("t", f"c{i}", _entry(i, 4e9)))
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(reg) == 10_000 and evicted == 90_000  # evicted leases go back to D
    assert used < 10_000 * 4096, used


@pytest.mark.timing
def test_redis_state_is_bounded(fresh_redis: RedisServer) -> None:
    """100k conversations written to Redis: under 2 KiB each while alive, every key with a
    TTL at its lease's expiry, and keys gone once their leases ended."""

    async def write(n: int, expiry: float, prefix: str) -> None:
        state = RedisState(fresh_redis.url, RouterMetrics(), timeout_s=2.0)
        # As many calls at once as the pool has connections: with more (1000 at once, as
        # this test once did) a call also waits for a free connection, bounded by the same
        # timeout_s, and on a loaded 2-core host that wait ran out ("No connection
        # available"), which RedisState rightly treats as a Redis failure.
        width = state.max_connections
        for start in range(0, n, width):
            results = await asyncio.gather(*(state.replace("t", f"{prefix}{i}", _entry(i, expiry))
                                             for i in range(start, min(n, start + width))))
            assert all(r == [] for r in results)
        await state.close()

    with fresh_redis.client() as r:
        before = r.info("memory")["used_memory"]
        asyncio.run(write(100_000, time.time() + 120, "c"))
        used = r.info("memory")["used_memory"] - before
        assert r.dbsize() == 100_000
        assert len(encode_entry(_entry(1, 1.0))) < 1024
        assert used < 100_000 * 2048, used
        ttls = [r.pttl(f"kvferry:conv:t:c{i}") for i in range(0, 100_000, 997)]
        assert all(0 < t <= 120_000 for t in ttls)
        r.flushall()
        asyncio.run(write(1000, time.time() + 1.0, "short"))
        wait_for(lambda: r.dbsize() == 0, 20, "keys expiring with their leases")
