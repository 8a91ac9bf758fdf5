"""Router fleet over real HTTP: replicas sharing conversations in a real Redis, engines from
a discovery file, health ejection and re-admission, prefill retries, SIGTERM drain.

Fake engines (tests/helpers_http.py) answer like vLLM; D's lease offers come from a real
D-side LeaseKeeper whose lease-control server the routers call to release leases. Redis is
a real `redis-server` (Debian's package; .ci/setup installs it; tests/fleet_stack.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fleet_stack import RedisServer, wait_for
from helpers_fleet import AUTH, KEY, P_PARAMS, LeasingD, metric, metric_sum, reuse_of
from helpers_http import FakeEngine, closed_port_url, free_port, serve

from kvferry.connectors.protocol.params import SECRET_ENV
from kvferry.router.app import create_app
from kvferry.router.metrics import RouterMetrics
from kvferry.router.registry import ConversationEntry, ConversationRegistry
from kvferry.router.settings import RouterSettings
from kvferry.router.state import RedisState, encode_entry

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    srv = RedisServer()
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def fresh_redis(redis_server: RedisServer) -> RedisServer:
    if redis_server.proc is None:
        redis_server.start()
    with redis_server.client() as c:
        c.flushall()
    return redis_server


# -- helpers ---------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, KEY.decode())  # D's keeper signs and verifies with it


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


def router(stack: ExitStack, **kw: Any) -> tuple[str, FastAPI]:
    kw.setdefault("health_interval_s", 0)
    app = create_app(RouterSettings(**kw), KEY)
    return stack.enter_context(serve(app)), app


def turn(url: str, cid: str = "c1", **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "conversation_id": cid, **extra}
    return httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=10,
                      trust_env=False)


@pytest.fixture
def pd(stack: ExitStack) -> tuple[FakeEngine, LeasingD, str, str]:
    p, d = FakeEngine("p0", kv_params=dict(P_PARAMS)), LeasingD()
    stack.callback(d.server.close)
    purl, durl = (stack.enter_context(serve(e.app())) for e in (p, d.engine))
    return p, d, purl, durl


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


# -- 2. discovery -----------------------------------------------------------------------------
def test_discovery_file_adds_and_removes_engines(tmp_path: Path, pd, stack) -> None:
    p, d0, purl, d0url = pd
    d1 = LeasingD("d1")
    stack.callback(d1.server.close)
    d1url = stack.enter_context(serve(d1.engine.app()))
    engines = tmp_path / "engines.json"

    def publish(*ds: tuple[str, LeasingD]) -> None:
        tmp = engines.with_suffix(".tmp")
        tmp.write_text(json.dumps({"decode": [
            {"url": u, "control_addr": f"127.0.0.1:{x.control_port}"} for u, x in ds]}))
        tmp.replace(engines)

    publish((d0url, d0))
    url, app = router(stack, prefill_urls=[purl], decode_urls=[], engines_file=str(engines),
                      discovery_interval_s=0.05)
    fleet, pool = app.state.fleet, app.state.pools["decode"]
    assert [u.url for u in pool.upstreams] == [d0url]
    assert turn(url).status_code == 200 and len(d0.engine.received) == 1
    assert turn(url).status_code == 200 and reuse_of(p) is not None  # reuse on D0

    n = fleet.reloads
    publish((d1url, d1))  # D0 leaves, D1 arrives
    wait_for(lambda: fleet.reloads > n, what="engines file reloaded")
    assert [u.url for u in pool.upstreams] == [d1url]
    r = turn(url)
    assert r.status_code == 200 and r.headers["x-kvferry-decode"] == d1url
    assert reuse_of(p) is None  # its KV was on D0, gone: recompute, no error
    assert metric(app, "kvferry_router_stale_conversations_total") == 1
    assert len(d0.engine.received) == 2 and len(d1.engine.received) == 1
    assert turn(url).status_code == 200 and reuse_of(p)["engine_id"] == "d1-engine"

    n = fleet.reloads
    publish((d0url, d0), (d1url, d1))
    wait_for(lambda: fleet.reloads > n, what="engines file reloaded")
    for cid in ("x1", "x2", "x3", "x4"):
        assert turn(url, cid).status_code == 200
    assert len(d0.engine.received) > 2  # the newcomer gets work
    assert metric(app, "kvferry_router_discovery_changes_total", role="decode", change="added") == 3
    assert metric(app, "kvferry_router_discovery_changes_total", role="decode",
                  change="removed") == 1
    assert metric(app, "kvferry_router_upstreams", role="decode") == 2

    engines.write_text("{not json")  # a broken file keeps the last engines
    wait_for(lambda: fleet.invalid == 1, what="broken file read")
    assert turn(url, "x5").status_code == 200 and len(pool.upstreams) == 2


# -- 3. health ----------------------------------------------------------------------------------
def sick_app(eng: FakeEngine, flag: dict[str, bool]) -> FastAPI:
    app = eng.app()

    @app.middleware("http")
    async def sick(request: Request, call_next: Any) -> Any:
        if flag["sick"]:
            return JSONResponse({"error": "sick"}, status_code=503)
        return await call_next(request)

    return app


def test_ejection_and_readmission(stack) -> None:
    p = FakeEngine("p0", kv_params=dict(P_PARAMS))
    d0, d1 = FakeEngine("d0"), FakeEngine("d1")
    flag = {"sick": False}
    purl = stack.enter_context(serve(p.app()))
    d0url = stack.enter_context(serve(d0.app()))
    d1url = stack.enter_context(serve(sick_app(d1, flag)))
    url, app = router(stack, prefill_urls=[purl], decode_urls=[d0url, d1url],
                      health_interval_s=0.05, eject_after=2)
    fleet, pool = app.state.fleet, app.state.pools["decode"]
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3}

    def post() -> httpx.Response:
        return httpx.post(url + "/v1/completions", json=body, timeout=10, trust_env=False)

    flag["sick"] = True
    wait_for(lambda: not pool.get(d1url).healthy, what="D1 ejected")
    assert metric(app, "kvferry_router_ejections_total", role="decode", upstream=d1url) == 1
    assert metric(app, "kvferry_router_upstream_healthy", role="decode", upstream=d1url) == 0
    assert httpx.get(url + "/health", trust_env=False).json()["decode"][1]["ejected"] is True
    seen = len(d1.received)
    for _ in range(4):
        assert post().status_code == 200
    assert len(d1.received) == seen  # no work for an ejected engine

    flag["sick"] = False
    wait_for(lambda: pool.get(d1url).healthy, what="D1 re-admitted")
    assert metric(app, "kvferry_router_readmissions_total", role="decode", upstream=d1url) == 1
    n = fleet.probes
    wait_for(lambda: fleet.probes > n)
    for _ in range(4):
        assert post().status_code == 200
    assert len(d1.received) > seen


def test_passive_failures_eject(stack) -> None:
    """Requests that fail count like probes: a P refusing connections is ejected."""
    p1 = FakeEngine("p1", kv_params=dict(P_PARAMS))
    dead = closed_port_url()
    purl = stack.enter_context(serve(p1.app()))
    durl = stack.enter_context(serve(FakeEngine("d0").app()))
    url, app = router(stack, prefill_urls=[dead, purl], decode_urls=[durl], eject_after=1)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3}
    for _ in range(4):
        r = httpx.post(url + "/v1/completions", json=body, timeout=10, trust_env=False)
        assert r.status_code == 200 and r.headers["x-kvferry-prefill"] == purl
    # The first request chose the dead P (ties start at the first), failed before any
    # byte reached the client, and was retried once on P1; then the dead P was ejected.
    assert metric(app, "kvferry_router_retries_total", leg="prefill", mode="pull") == 1
    assert metric(app, "kvferry_router_ejections_total", role="prefill", upstream=dead) == 1
    assert len(p1.received) == 4


def test_prefill_retry_needs_another_prefill(stack) -> None:
    durl = stack.enter_context(serve(FakeEngine("d0").app()))
    url, app = router(stack, prefill_urls=[closed_port_url()], decode_urls=[durl])
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=10, trust_env=False)
    assert r.status_code == 502
    assert metric_sum(app, "kvferry_router_retries_total") == 0


def test_push_prefill_retry_before_decode_answered(stack) -> None:
    """Push sends both legs at once: when P fails before D answered, D's leg is cancelled
    and both go again on another P (the new D leg names that P's side channel)."""
    p1 = FakeEngine("p1", kv_params=dict(P_PARAMS))
    d = FakeEngine("d0", delay_s=1.0)  # like a D waiting for P's KV to arrive
    purl = stack.enter_context(serve(p1.app()))
    durl = stack.enter_context(serve(d.app()))
    url, app = router(stack, prefill_urls=[closed_port_url(), purl], decode_urls=[durl],
                      prefill_kv_addrs=["127.0.0.1:5601", "127.0.0.1:5602"])
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                   headers={"x-kvferry-mode": "push"}, timeout=10, trust_env=False)
    assert r.status_code == 200 and r.headers["x-kvferry-prefill"] == purl
    assert metric(app, "kvferry_router_retries_total", leg="prefill", mode="push") == 1
    # D serves the leg naming P1's side channel, under P1's transfer; the first D leg was
    # cancelled (before or after it reached D, depending on how fast P failed).
    last = d.received[-1]["kv_transfer_params"]
    assert last["remote_port"] == 5602 and len(p1.received) == 1
    assert p1.received[0]["kv_transfer_params"]["transfer_id"] == last["transfer_id"]
    assert [b["kv_transfer_params"]["remote_port"] for b in d.received[:-1]] in ([], [5601])


# -- 4. drain -----------------------------------------------------------------------------------
def test_sigterm_drains_in_flight_streams_and_exits_0(stack) -> None:
    p = FakeEngine("p0", kv_params=dict(P_PARAMS))
    d = FakeEngine("d0", chunks=6, chunk_delay_s=0.2)
    purl = stack.enter_context(serve(p.app()))
    durl = stack.enter_context(serve(d.app()))
    port = free_port()
    # The caller's PYTHONPATH first (a worktree's shim), so the router run is this code.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvferry.scripts.cli", "router", "--prefill", purl,
         "--decode", durl, "--port", str(port), "--drain-timeout", "10",
         "--health-interval", "0", "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stack.callback(lambda: proc.poll() is None and proc.kill())
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/health", timeout=1, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, 30, "router up")
    got: list[bytes] = []
    started = threading.Event()

    def stream() -> None:
        body = {"prompt": "hi", "max_tokens": 6, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=20,
                          trust_env=False) as r:
            for chunk in r.iter_bytes():
                got.append(chunk)
                started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(10)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0, proc.stderr.read().decode()
    t.join(10)
    raw = b"".join(got)
    assert raw.count(b"tok") == 6 and raw.rstrip().endswith(b"data: [DONE]")
    assert not up()  # it stopped accepting


def test_dns_discovery_follows_the_names_answers(pd, stack) -> None:
    """Engines found by DNS names, as a Kubernetes headless Service publishes them: real
    lookups of `localhost`, and a test zone over the real resolver for the name whose
    answer changes (no DNS server here): NXDOMAIN empties it, a failed lookup keeps it."""
    p, d0, purl, d0url = pd
    pport, dport = int(purl.rsplit(":", 1)[1]), int(d0url.rsplit(":", 1)[1])
    url, app = router(stack, prefill_urls=[], decode_urls=[],
                      prefill_dns=[f"localhost:{pport}"], decode_dns=[f"decode.test:{dport}"],
                      prefill_kv_port=5655, decode_control_port=d0.control_port,
                      dns_interval_s=0.05)
    fleet, pools = app.state.fleet, app.state.pools
    zone = {"answer": "up"}
    real = fleet.getaddrinfo

    async def resolve(host: str, port: int, **kw: Any) -> Any:
        if host == "decode.test":
            if zone["answer"] == "nxdomain":
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            if zone["answer"] == "servfail":
                raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
            host = "localhost"
        return await (real or asyncio.get_running_loop().getaddrinfo)(host, port, **kw)

    fleet.getaddrinfo = resolve

    def rounds_after(n: int) -> None:
        wait_for(lambda: fleet.dns_rounds > n + 1, what="DNS rounds")

    rounds_after(fleet.dns_rounds)
    assert [u.url for u in pools["prefill"].upstreams] == [purl]
    assert [u.url for u in pools["decode"].upstreams] == [d0url]
    assert app.state.settings.prefill_kv_addr(purl) == ("127.0.0.1", 5655)
    assert turn(url).status_code == 200
    assert turn(url).status_code == 200 and reuse_of(p)["engine_id"] == "d0-engine"

    zone["answer"] = "servfail"  # the resolver is down: keep what it said last
    rounds_after(fleet.dns_rounds)
    assert [u.url for u in pools["decode"].upstreams] == [d0url]

    zone["answer"] = "nxdomain"  # no ready pod behind the Service: no engine
    rounds_after(fleet.dns_rounds)
    assert pools["decode"].upstreams == []
    assert metric(app, "kvferry_router_discovery_changes_total", role="decode",
                  change="removed") == 1

    zone["answer"] = "up"  # the pod is back: it gets work, its conversations recompute
    rounds_after(fleet.dns_rounds)
    assert [u.url for u in pools["decode"].upstreams] == [d0url]
    assert turn(url, "c2").status_code == 200


def test_dns_names_alone_are_a_valid_configuration() -> None:
    s = RouterSettings(prefill_urls=[], decode_urls=[], prefill_dns=["p.svc:8100"],
                       decode_dns=["d.svc:8200"])
    assert s.discovers
    with pytest.raises(ValueError, match="host:port"):
        RouterSettings(prefill_urls=[], decode_urls=[], prefill_dns=["p.svc"])
