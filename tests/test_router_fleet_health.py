"""Router fleet over real HTTP, health: ejection and re-admission, passive failures, and
prefill retries that need another prefill engine.

Fake engines (tests/helpers_http.py) answer like vLLM; a sick one fails on a flag."""

from __future__ import annotations

from typing import Any

import helpers_router_fleet
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fleet_stack import wait_for
from helpers_fleet import P_PARAMS, metric, metric_sum
from helpers_http import OPERATOR, FakeEngine, closed_port_url, serve
from helpers_router_fleet import router

_secret = helpers_router_fleet._secret
stack = helpers_router_fleet.stack


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

    wait_for(lambda: pool.get(d1url).state == "healthy", what="D1 healthy")  # not starting
    flag["sick"] = True
    wait_for(lambda: not pool.get(d1url).healthy, what="D1 ejected")
    assert metric(app, "kvferry_router_ejections_total", role="decode",
                  upstream=app.state.pools["decode"].name_of(d1url)) == 1
    assert metric(app, "kvferry_router_upstream_healthy", role="decode",
                  upstream=app.state.pools["decode"].name_of(d1url)) == 0
    health = httpx.get(url + "/health", trust_env=False, headers=OPERATOR).json()
    assert health["decode"][1]["state"] == "ejected"
    seen = len(d1.received)
    for _ in range(4):
        assert post().status_code == 200
    assert len(d1.received) == seen  # no work for an ejected engine

    flag["sick"] = False
    wait_for(lambda: pool.get(d1url).healthy, what="D1 re-admitted")
    assert metric(app, "kvferry_router_readmissions_total", role="decode",
                  upstream=app.state.pools["decode"].name_of(d1url)) == 1
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
        r = httpx.post(url + "/v1/completions", json=body, timeout=10, trust_env=False,
                       headers=OPERATOR)
        assert r.status_code == 200 and r.headers["x-kvferry-prefill"] == purl
    # The first request chose the dead P (ties start at the first), failed before any
    # byte reached the client, and was retried once on P1; then the dead P was ejected.
    assert metric(app, "kvferry_router_retries_total", leg="prefill", mode="pull") == 1
    assert metric(app, "kvferry_router_ejections_total", role="prefill",
                  upstream=app.state.pools["prefill"].name_of(dead)) == 1
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
                   headers={"x-kvferry-mode": "push", **OPERATOR}, timeout=10, trust_env=False)
    assert r.status_code == 200 and r.headers["x-kvferry-prefill"] == purl
    assert metric(app, "kvferry_router_retries_total", leg="prefill", mode="push") == 1
    # D serves the leg naming P1's side channel, under P1's transfer; the first D leg was
    # cancelled (before or after it reached D, depending on how fast P failed).
    last = d.received[-1]["kv_transfer_params"]
    assert last["remote_port"] == 5602 and len(p1.received) == 1
    assert p1.received[0]["kv_transfer_params"]["transfer_id"] == last["transfer_id"]
    assert [b["kv_transfer_params"]["remote_port"] for b in d.received[:-1]] in ([], [5601])
