"""Legs retried on another engine before any byte reached the client, over real HTTP:
a D or P that refuses the connection (a killed engine: nothing listens on its port) is
ejected at once and the same leg goes to another healthy engine, each engine at most once
per request; a P that saw the request and failed is retried once only.

Fake engines (tests/helpers_http.py, named as fakes: the legs' bytes are what matters
here); a refusing engine is a port with nothing listening. `tests/test_e2e_pull.py` has the
same D retry against real vLLM engines.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from helpers_fleet import AUTH, KEY, P_PARAMS, LeasingD, metric, reuse_of
from helpers_http import OPERATOR, FakeEngine, closed_port_url, dropping_server, free_port, serve
from prometheus_client.parser import text_string_to_metric_families

from kvferry.connectors.protocol.params import SECRET_ENV
from kvferry.router.api.app import create_app
from kvferry.router.settings import RouterSettings

BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 3}


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, KEY.decode())


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


def router(stack: ExitStack, **kw: Any) -> tuple[str, FastAPI]:
    kw.setdefault("health_interval_s", 0)  # no probes: only the requests eject
    app = create_app(RouterSettings(**kw), KEY)
    return stack.enter_context(serve(app)), app


def post(url: str, body: dict[str, Any] | None = None, **kw: Any) -> httpx.Response:
    kw["headers"] = {**OPERATOR, **kw.get("headers", {})}
    return httpx.post(url + "/v1/completions", json=body or BODY, timeout=10,
                      trust_env=False, **kw)


def posts(requests: list[bytes]) -> list[bytes]:
    """The requests a dropping server got that were POSTs (the router also asks each D's
    /v1/models and /version once, for its context length)."""
    return [r for r in requests if r.startswith(b"POST")]


def exposed(url: str, name: str, **labels: str) -> float | None:
    """A sample as /metrics shows it (None: absent)."""
    text = httpx.get(url + "/metrics", trust_env=False).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None


@pytest.mark.parametrize("stream", [False, True])
def test_refused_decode_leg_goes_to_another_decode(stack: ExitStack, stream: bool) -> None:
    p, d1 = FakeEngine("p0", kv_params=dict(P_PARAMS)), FakeEngine("d1", chunks=3)
    dead = closed_port_url()
    purl, d1url = (stack.enter_context(serve(e.app())) for e in (p, d1))
    url, app = router(stack, prefill_urls=[purl], decode_urls=[dead, d1url])  # eject_after 3
    body = {**BODY, "stream": stream}
    r = post(url, body)  # ties start at the first D: the dead one
    assert r.status_code == 200, r.text
    assert r.headers["x-kvferry-decode"] == d1url
    if stream:
        assert r.text.count("data: ") == 4 and "tok2" in r.text and r.text.endswith(
            "data: [DONE]\n\n")
    else:
        assert r.json()["choices"][0]["text"] == "d1 answer"
    # D1 got P's offer exactly as P returned it (it names P only): D1 READs P's blocks.
    assert len(p.received) == 1 and len(d1.received) == 1
    assert d1.received[0]["kv_transfer_params"] == P_PARAMS
    assert metric(app, "kvferry_router_retries_total", leg="decode", mode="pull") == 1
    assert exposed(url, "kvferry_router_retries_total", leg="decode", mode="pull") == 1
    # One refusal ejected the dead D (not eject_after=3 of them); the request did not fail.
    assert metric(app, "kvferry_router_ejections_total", role="decode",
                  upstream=app.state.pools["decode"].name_of(dead)) == 1
    assert metric(app, "kvferry_router_upstream_healthy", role="decode",
                  upstream=app.state.pools["decode"].name_of(dead)) == 0
    assert metric(app, "kvferry_router_errors_total", endpoint="completions", leg="decode",
                  kind="connect") == 0
    r = post(url, body)  # the ejected D gets no more work: no second retry
    assert r.status_code == 200 and r.headers["x-kvferry-decode"] == d1url
    assert metric(app, "kvferry_router_retries_total", leg="decode", mode="pull") == 1
    assert len(p.received) == 2  # one prefill per request: the offer was reused, not redone


def test_every_decode_refusing_is_a_502_after_each_was_tried_once(stack: ExitStack) -> None:
    p = FakeEngine("p0", kv_params=dict(P_PARAMS))
    purl = stack.enter_context(serve(p.app()))
    dead = [closed_port_url(), closed_port_url()]
    url, app = router(stack, prefill_urls=[purl], decode_urls=dead)
    r = post(url)
    assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]
    assert metric(app, "kvferry_router_retries_total", leg="decode", mode="pull") == 1
    for d in dead:  # each tried once: each refused once, each ejected
        assert metric(app, "kvferry_router_ejections_total", role="decode",
                  upstream=app.state.pools["decode"].name_of(d)) == 1
    # Every D ejected: the pool still tries one (better than refusing for sure), but a
    # retry only goes to a healthy D; there is none, so no retry.
    assert post(url).status_code == 502
    assert metric(app, "kvferry_router_retries_total", leg="decode", mode="pull") == 1
    assert metric(app, "kvferry_router_errors_total", endpoint="completions", leg="decode",
                  kind="connect") == 2


def test_a_conversation_turn_commits_on_the_decode_that_answered(stack: ExitStack) -> None:
    p, d = FakeEngine("p0", kv_params=dict(P_PARAMS)), LeasingD("d1")
    stack.callback(d.server.close)
    purl, durl = (stack.enter_context(serve(e.app())) for e in (p, d.engine))
    dead = closed_port_url()
    url, app = router(stack, prefill_urls=[purl], decode_urls=[dead, durl],
                      decode_control_addrs=[f"127.0.0.1:{free_port()}",
                                            f"127.0.0.1:{d.control_port}"])
    body = {**BODY, "conversation_id": "c1"}
    assert post(url, body, headers=AUTH).status_code == 200
    assert metric(app, "kvferry_router_retries_total", leg="decode", mode="pull") == 1
    _, entry = app.state.conversations.lookup("c1", AUTH)
    assert entry is not None and entry.decode_url == durl
    assert d.reason(entry.lease_id) is None  # D1 granted and holds the turn's lease
    # The next turn offers P D1's lease: the conversation goes on from the D that answered.
    assert post(url, body, headers=AUTH).status_code == 200
    assert reuse_of(p)["lease_id"] == entry.lease_id


def test_refused_prefills_are_each_tried_once_a_failing_one_once_only(stack: ExitStack
                                                                     ) -> None:
    live = FakeEngine("p2", kv_params=dict(P_PARAMS))
    sick = FakeEngine("p1", status=503)
    d = FakeEngine("d0")
    lurl, surl, durl = (stack.enter_context(serve(e.app())) for e in (live, sick, d))
    dead = [closed_port_url(), closed_port_url()]

    # Two refusing Ps, then a live one: the leg goes on until a P takes it.
    url, app = router(stack, prefill_urls=[*dead, lurl], decode_urls=[durl])
    r = post(url)
    assert r.status_code == 200 and r.headers["x-kvferry-prefill"] == lurl
    assert metric(app, "kvferry_router_retries_total", leg="prefill", mode="pull") == 2
    for u in dead:
        assert metric(app, "kvferry_router_ejections_total", role="prefill",
                  upstream=app.state.pools["prefill"].name_of(u)) == 1

    # A refusing P, then one that saw the request and failed (503): retried once more.
    url, app = router(stack, prefill_urls=[dead[0], surl, lurl], decode_urls=[durl])
    r = post(url)
    assert r.status_code == 200 and r.headers["x-kvferry-prefill"] == lurl
    assert metric(app, "kvferry_router_retries_total", leg="prefill", mode="pull") == 2

    # Two failing Ps that saw the request: one retry only, the third P is never asked.
    sick2 = FakeEngine("p1b", status=503)
    s2url = stack.enter_context(serve(sick2.app()))
    n_live = len(live.received)
    url, app = router(stack, prefill_urls=[surl, s2url, lurl], decode_urls=[durl])
    r = post(url)
    assert r.status_code == 502 and "HTTP 503" in r.json()["error"]["message"]
    assert metric(app, "kvferry_router_retries_total", leg="prefill", mode="pull") == 1
    assert len(sick2.received) == 1 and len(live.received) == n_live


def test_push_prefill_moves_past_every_refusing_prefill(stack: ExitStack) -> None:
    p = FakeEngine("p2", kv_params=dict(P_PARAMS))
    d = FakeEngine("d0", delay_s=1.0)  # like a D waiting for P's KV to arrive
    purl, durl = (stack.enter_context(serve(e.app())) for e in (p, d))
    url, app = router(stack, prefill_urls=[closed_port_url(), closed_port_url(), purl],
                      decode_urls=[durl], prefill_kv_addrs=[
                          "127.0.0.1:5601", "127.0.0.1:5602", "127.0.0.1:5603"])
    r = post(url, headers={"x-kvferry-mode": "push"})
    assert r.status_code == 200 and r.headers["x-kvferry-prefill"] == purl
    assert metric(app, "kvferry_router_retries_total", leg="prefill", mode="push") == 2
    assert d.received[-1]["kv_transfer_params"]["remote_port"] == 5603


@pytest.mark.parametrize("stream", [False, True])
def test_push_refused_decode_leg_goes_to_another_decode(stack: ExitStack, stream: bool) -> None:
    """Push: a D that refused the connection never registered with P, so another D takes
    the same leg (same transfer id, same P side channel) and P's leg goes on."""
    p = FakeEngine("p0", kv_params=dict(P_PARAMS), delay_s=0.3)
    d1 = FakeEngine("d1", chunks=3)
    dead = closed_port_url()
    purl, d1url = (stack.enter_context(serve(e.app())) for e in (p, d1))
    url, app = router(stack, prefill_urls=[purl], decode_urls=[dead, d1url],
                      prefill_kv_addrs=["127.0.0.1:5601"])
    r = post(url, {**BODY, "stream": stream}, headers={"x-kvferry-mode": "push"})
    assert r.status_code == 200, r.text
    assert r.headers["x-kvferry-decode"] == d1url
    tid = r.headers["x-kvferry-transfer-id"]
    kv = d1.received[0]["kv_transfer_params"]
    assert kv["transfer_id"] == tid and kv["push"] is True and kv["remote_port"] == 5601
    assert len(p.received) == 1 and p.received[0]["kv_transfer_params"]["transfer_id"] == tid
    assert not p.disconnected.is_set()  # P's leg was not cancelled
    if stream:
        assert "tok2" in r.text and r.text.endswith("data: [DONE]\n\n")
        assert "kvferry_prefill_ms" in r.text  # P's report, before [DONE]
    else:
        assert r.json()["choices"][0]["text"] == "d1 answer"
        assert float(r.headers["x-kvferry-prefill-ms"]) > 0  # P's report, once P answered
    assert metric(app, "kvferry_router_retries_total", leg="decode", mode="push") == 1
    assert metric(app, "kvferry_router_ejections_total", role="decode",
                  upstream=app.state.pools["decode"].name_of(dead)) == 1


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_request_whose_decode_died_holding_it_is_served_by_another_pair(
        stack: ExitStack, mode: str, stream: bool) -> None:
    """A D that took the request and dropped the connection before answering (it died):
    the client has seen nothing, so the request is served afresh (a new prefill and
    transfer: P's first offer may be read and freed already, never handed to another D)."""
    p, d1 = FakeEngine("p0", kv_params=dict(P_PARAMS)), FakeEngine("d1")
    dying, dropped = stack.enter_context(dropping_server())
    purl, d1url = (stack.enter_context(serve(e.app())) for e in (p, d1))
    url, app = router(stack, prefill_urls=[purl], decode_urls=[dying, d1url],
                      prefill_kv_addrs=["127.0.0.1:5601"])
    r = post(url, {**BODY, "stream": stream}, headers={"x-kvferry-mode": mode})  # ties
    assert r.status_code == 200, r.text  # start at the first D: the dying one
    if stream:
        assert "tok3" in r.text and r.text.endswith("data: [DONE]\n\n")
    else:
        assert r.json()["choices"][0]["text"] == "d1 answer"
    assert r.headers["x-kvferry-decode"] == d1url
    assert len(posts(dropped)) == 1 and len(d1.received) == 1 and len(p.received) == 2
    ids = {h["x-request-id"] for h in p.headers}
    assert len(ids) == 2 and d1.headers[0]["x-request-id"] in ids  # a new transfer
    assert metric(app, "kvferry_router_migrations_total", result="rerun") == 1


def test_a_request_on_the_last_decode_is_not_rerun(stack: ExitStack) -> None:
    """A request is asked afresh only while another healthy D is left: here the one D
    dies holding it, a clear 502."""
    p = FakeEngine("p0", kv_params=dict(P_PARAMS))
    dying, dropped = stack.enter_context(dropping_server())
    purl = stack.enter_context(serve(p.app()))
    url, app = router(stack, prefill_urls=[purl], decode_urls=[dying])
    r = post(url)
    assert r.status_code == 502 and "decode upstream" in r.json()["error"]["message"]
    assert len(posts(dropped)) == 1 and len(p.received) == 1
    assert metric(app, "kvferry_router_migrations_total", result="rerun") == 0
