"""Router push mode and the prefill timing values, over real HTTP with fake engines."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from helpers_http import FakeEngine, serve

from kvferry.router.api.app import create_app
from kvferry.router.settings import RouterSettings
from kvferry.router.wire.headers import parse_report_comment
from kvferry.scripts.bench_core import Result, Target, send_request

PUSH_REPORT_WAIT_S = RouterSettings.model_fields["push_report_wait_s"].default
P_PARAMS = {"do_remote_prefill": True, "remote_block_ids": [3], "remote_engine_id": "p0",
            "remote_host": "127.0.0.1", "remote_port": 5600}
KV_ADDR = ("10.1.2.3", 5655)
PUSH = {"x-kvferry-mode": "push"}

Cluster = tuple[str, FakeEngine, FakeEngine]


@pytest.fixture
def cluster() -> Iterator[Callable[..., Cluster]]:
    """Factory: one fake P, one fake D, a router with P's side-channel address."""
    stack = ExitStack()

    def make(kv: bool = True, **overrides: Any) -> Cluster:
        p, d = FakeEngine("p0", kv_params=dict(P_PARAMS)), FakeEngine("d0")
        purl, durl = (stack.enter_context(serve(e.app())) for e in (p, d))
        addrs = [f"{KV_ADDR[0]}:{KV_ADDR[1]}"] if kv else []
        settings = RouterSettings(prefill_urls=[purl], decode_urls=[durl],
                                  prefill_kv_addrs=addrs, **overrides)
        return stack.enter_context(serve(create_app(settings))), p, d

    with stack:
        yield make


def wait_for(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def in_flight(client: httpx.Client, url: str) -> list[int]:
    health = client.get(url + "/health").json()
    return [u["in_flight"] for u in health["prefill"] + health["decode"]]


def report_of(text: str) -> dict[str, Any]:
    """The router's report comment of a push stream (`wire.report_comment`)."""
    (report,) = [r for line in text.splitlines() if (r := parse_report_comment(line)) is not None]
    return report


def sse_events(text: str) -> list[str]:
    return [ln[5:].strip() for ln in text.splitlines() if ln.startswith("data:")]


@pytest.mark.timing
def test_push_legs_concurrent_bodies_and_json_timing(
    cluster: Callable[..., Cluster], client: httpx.Client
) -> None:
    url, p, d = cluster()
    p.delay_s, d.delay_s = 0.3, 0.8  # D is asked before P answers; P answers before D
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "conversation_id": "c",
            "kv_transfer_params": {"remote_host": "evil", "remote_block_ids": [666]}}
    r = client.post(url + "/v1/completions", json=body,
                    headers={**PUSH, "Authorization": "Bearer k"})
    assert r.status_code == 200, r.text
    assert d.received_at[0] < p.answered_at[0]
    tid = r.headers["x-kvferry-transfer-id"]
    (pb,), (db,) = p.received, d.received
    assert pb["kv_transfer_params"] == {"do_remote_decode": True, "push": True,
                                        "transfer_id": tid}
    assert pb["max_tokens"] == 1 and pb["stream"] is False and "conversation_id" not in pb
    assert db == {"model": "tiny", "prompt": "hello", "max_tokens": 8, "kv_transfer_params": {
        "do_remote_prefill": True, "push": True, "transfer_id": tid,
        "remote_host": KV_ADDR[0], "remote_port": KV_ADDR[1]}}
    assert p.headers[0]["x-request-id"] == d.headers[0]["x-request-id"] == tid
    assert p.headers[0]["authorization"] == d.headers[0]["authorization"] == "Bearer k"
    out = r.json()
    assert "kv_transfer_params" not in out and out["choices"][0]["text"] == "d0 answer"
    assert 300 <= float(r.headers["x-kvferry-prefill-ms"]) < 800  # a JSON answer's headers
    assert "kvferry_prefill_ms" not in out  # leave after P's: no field beyond OpenAI's
    assert r.headers["x-kvferry-prefill"] and r.headers["x-kvferry-decode"]


def test_push_names_prefill_engine_for_vllm_push_connector(
    cluster: Callable[..., Cluster], client: httpx.Client
) -> None:
    """With prefill_engine_ids (vLLM's NixlPushConnector), D also learns P's engine id and
    TP size up front; both legs share one x-request-id (vLLM matches on it)."""
    url, p, d = cluster(prefill_engine_ids=["prefill-7"], prefill_tp_size=2)
    r = client.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=PUSH)
    assert r.status_code == 200, r.text
    kv = d.received[0]["kv_transfer_params"]
    assert kv["remote_engine_id"] == "prefill-7" and kv["tp_size"] == 2
    assert kv["remote_request_id"] == kv["transfer_id"] == r.headers["x-kvferry-transfer-id"]
    assert kv["do_remote_prefill"] is True and kv["remote_port"] == KV_ADDR[1]
    wait_for(lambda: bool(p.received))  # P's leg runs in the background
    assert "remote_engine_id" not in p.received[0]["kv_transfer_params"]
    assert p.headers[0]["x-request-id"] == d.headers[0]["x-request-id"]


def test_json_answer_waits_for_a_prefill_answer_that_is_due(
    cluster: Callable[..., Cluster], client: httpx.Client
) -> None:
    """D answered first (the router read D's answer before P's, as CI saw with real
    engines): the JSON answer still carries P's fields, P answering within the wait."""
    url, p, d = cluster()
    p.delay_s, d.delay_s = 0.6, 0.1
    r = client.post(url + "/v1/completions", headers=PUSH, json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 200, r.text
    assert d.answered_at[0] < p.answered_at[0]
    assert 600 <= float(r.headers["x-kvferry-prefill-ms"]) < 600 + PUSH_REPORT_WAIT_S * 1000


def test_push_slow_prefill_does_not_hold_decode(
    cluster: Callable[..., Cluster], client: httpx.Client
) -> None:
    url, p, d = cluster(mode="push")  # push by default
    p.delay_s = PUSH_REPORT_WAIT_S + 2.0
    t0 = time.monotonic()
    r = client.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
    # D's answer waits for P's at most PUSH_REPORT_WAIT_S (PushPrefill.settle)
    assert r.status_code == 200 and time.monotonic() - t0 < PUSH_REPORT_WAIT_S + 1.0
    assert "x-kvferry-prefill-ms" not in r.headers  # P had not answered yet
    wait_for(lambda: len(p.received) == 1)
    assert len(d.received) == 1
    # D succeeded, so P's leg is left to finish on its own (not cancelled).
    wait_for(lambda: len(p.answered_at) == 1)
    assert not p.disconnected.is_set()
    wait_for(lambda: in_flight(client, url) == [0, 0])


@pytest.mark.timing
def test_push_stream_timing_event_before_done(
    cluster: Callable[..., Cluster], client: httpx.Client
) -> None:
    url, p, d = cluster()
    p.delay_s = 0.2
    d.chunks, d.chunk_delay_s = 4, 0.15
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "kvferry_mode": "push"}
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = sse_events(text)
    assert events[-1] == "[DONE]" and len(events) == 5  # D's four, no event of the router's
    assert 200 <= report_of(text)["kvferry_prefill_ms"] < 600  # an SSE comment
    assert [f"tok{i}" in e for i, e in enumerate(events[:4])] == [True] * 4
    assert d.received[0]["stream"] is True and d.received[0]["messages"][0]["content"] == "hi"
    assert "kvferry_mode" not in d.received[0] and "kvferry_mode" not in p.received[0]


def test_push_stream_done_waits_for_a_prefill_answer_that_is_due(
    cluster: Callable[..., Cluster], client: httpx.Client
) -> None:
    """D's stream ended before the router had P's answer: its [DONE] waits for P's report
    (within PUSH_REPORT_WAIT_S), so the reuse and timing fields are not lost."""
    url, p, d = cluster()
    p.delay_s = 0.6
    with client.stream("POST", url + "/v1/completions", headers=PUSH,
                       json={"model": "tiny", "prompt": "x", "stream": True}) as r:
        text = r.read().decode()
    assert d.answered_at[0] < p.answered_at[0]
    assert sse_events(text)[-1] == "[DONE]"
    assert 600 <= report_of(text)["kvferry_prefill_ms"] < 600 + PUSH_REPORT_WAIT_S * 1000


def test_push_stream_without_prefill_answer_has_no_timing_event(
    cluster: Callable[..., Cluster], client: httpx.Client
) -> None:
    url, p, _ = cluster()
    p.delay_s = PUSH_REPORT_WAIT_S + 1.5
    t0 = time.monotonic()
    with client.stream("POST", url + "/v1/completions", headers=PUSH,
                       json={"model": "tiny", "prompt": "x", "stream": True}) as r:
        text = r.read().decode()
    assert time.monotonic() - t0 < PUSH_REPORT_WAIT_S + 1.0  # a slow P never holds D's stream
    assert "kvferry_prefill_ms" not in text and sse_events(text)[-1] == "[DONE]"


def test_mode_header_and_body_field(cluster: Callable[..., Cluster], client: httpx.Client) -> None:
    url, p, d = cluster(mode="push")
    body = {"model": "tiny", "prompt": "x"}
    r = client.post(url + "/v1/completions", json=body, headers={"x-kvferry-mode": "pull"})
    assert r.status_code == 200
    assert "push" not in p.received[-1]["kv_transfer_params"]
    assert d.received[-1]["kv_transfer_params"] == P_PARAMS  # pull: P's answer goes to D
    assert float(r.headers["x-kvferry-prefill-ms"]) >= 0
    r = client.post(url + "/v1/completions", json={**body, "kvferry_mode": "pull"}, headers=PUSH)
    assert r.status_code == 200  # the header wins over the body field
    wait_for(lambda: len(p.received) == 2)  # P's leg runs in the background
    assert p.received[-1]["kv_transfer_params"]["push"] is True
    assert d.received[-1]["kv_transfer_params"]["remote_port"] == KV_ADDR[1]
    metrics = client.get(url + "/metrics").text
    assert 'kvferry_router_requests_total{endpoint="completions",mode="push"} 1.0' in metrics
    assert 'kvferry_router_requests_total{endpoint="completions",mode="pull"} 1.0' in metrics


def test_push_without_prefill_kv_is_400(
    cluster: Callable[..., Cluster], client: httpx.Client
) -> None:
    url, p, d = cluster(kv=False)
    r = client.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=PUSH)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "push needs --prefill-kv for <engine>"  # no address
    assert p.received == [] and d.received == []
    assert in_flight(client, url) == [0, 0]


def test_client_disconnect_during_push_stream_closes_both_legs(
    cluster: Callable[..., Cluster], client: httpx.Client
) -> None:
    url, p, d = cluster()
    p.delay_s = 10
    d.chunks, d.chunk_delay_s = 50, 0.1
    with client.stream("POST", url + "/v1/completions", headers=PUSH,
                       json={"model": "tiny", "prompt": "x", "stream": True}) as r:
        assert r.status_code == 200, r.read()
        chunks = r.iter_bytes()  # keep a reference: dropping it closes the connection
        next(chunks)
        assert in_flight(client, url) == [1, 1]
        assert not p.disconnected.is_set() and not d.stream_closed_early.is_set()
    assert d.stream_closed_early.wait(5)
    assert p.disconnected.wait(5)
    wait_for(lambda: in_flight(client, url) == [0, 0])
    assert p.answered_at == []


def test_decode_failure_cancels_prefill(
    cluster: Callable[..., Cluster], client: httpx.Client
) -> None:
    url, p, d = cluster()
    p.delay_s, d.status, d.delay_s = 10, 503, 0.3  # D fails once P has its request
    for stream in (False, True):
        r = client.post(url + "/v1/completions", headers=PUSH,
                        json={"model": "tiny", "prompt": "x", "stream": stream})
        assert r.status_code == 502 and "decode" in r.json()["error"]["message"]
        assert p.disconnected.wait(5)
        p.disconnected.clear()
    wait_for(lambda: in_flight(client, url) == [0, 0])
    assert p.answered_at == []


def test_prefill_failure_leaves_decode_alone(
    cluster: Callable[..., Cluster], client: httpx.Client
) -> None:
    url, p, d = cluster()
    p.status, d.delay_s = 500, 0.5
    r = client.post(url + "/v1/completions", headers=PUSH, json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "d0 answer"
    assert "kvferry_prefill_ms" not in r.json()
    assert not d.disconnected.is_set()
    metrics = client.get(url + "/metrics").text
    assert 'kvferry_router_push_prefill_failures_total{kind="http_500"} 1.0' in metrics


@pytest.mark.timing
def test_pull_timing_header(cluster: Callable[..., Cluster], client: httpx.Client) -> None:
    url, p, _ = cluster()
    p.delay_s = 0.2
    r = client.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert 200 <= float(r.headers["x-kvferry-prefill-ms"]) < 600
    with client.stream("POST", url + "/v1/completions",
                       json={"model": "tiny", "prompt": "x", "stream": True}) as r:
        assert 200 <= float(r.headers["x-kvferry-prefill-ms"]) < 600
        assert "kvferry_prefill_ms" not in r.read().decode()


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.timing
def test_bench_client_reads_prefill_ms(cluster: Callable[..., Cluster], mode: str) -> None:
    url, p, d = cluster()
    p.delay_s = 0.2
    d.chunks, d.chunk_delay_s = 3, 0.15

    async def one() -> Result:
        target = Target(name=mode, url=url, mode=mode, headers=(("x-kvferry-mode", mode),))
        async with httpx.AsyncClient(trust_env=False) as c:
            body = {"model": "tiny", "prompt": [11, 12], "max_tokens": 3, "stream": True}
            return await send_request(c, target, body, Result(target=mode, index=0,
                                                              prompt_len=2), 20)

    res = asyncio.run(one())
    assert res.ok, res.error
    assert res.prefill_ms is not None and 200 <= res.prefill_ms < 600
    assert res.n_tokens == 3
