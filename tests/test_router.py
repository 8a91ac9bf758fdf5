"""Router over real HTTP: fake vLLM engines and the router, each under uvicorn."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from helpers_http import FakeEngine, closed_port_url, serve

from kvferry.router.api.app import create_app
from kvferry.router.settings import RouterSettings

P_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [3, 4, 5],
    "remote_engine_id": "engine-p",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
}

Cluster = tuple[str, list[FakeEngine], list[FakeEngine]]


@pytest.fixture
def cluster() -> Iterator[Callable[..., Cluster]]:
    """Factory: start n_p fake P, n_d fake D and a router; everything stops after the test."""
    stack = ExitStack()

    def make(n_p: int = 1, n_d: int = 1, p_urls: list[str] | None = None,
             **overrides: Any) -> Cluster:
        ps = [FakeEngine(f"p{i}", kv_params=dict(P_PARAMS, remote_engine_id=f"p{i}"))
              for i in range(n_p)]
        ds = [FakeEngine(f"d{i}") for i in range(n_d)]
        purls = p_urls or [stack.enter_context(serve(e.app())) for e in ps]
        durls = [stack.enter_context(serve(e.app())) for e in ds]
        settings = RouterSettings(prefill_urls=purls, decode_urls=durls, **overrides)
        return stack.enter_context(serve(create_app(settings))), ps, ds

    with stack:
        yield make


def test_pull_completions_bodies(cluster: Callable[..., Cluster], client: httpx.Client) -> None:
    url, (p,), (d,) = cluster()
    body = {
        "model": "tiny", "prompt": "hello", "max_tokens": 16, "temperature": 0,
        "kv_transfer_params": {"remote_block_ids": [666], "remote_host": "evil"},
        "conversation_id": "c1",
    }
    r = client.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer k"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "d0 answer"
    assert "kv_transfer_params" not in r.json()

    (pb,) = p.received
    assert pb["max_tokens"] == 1 and pb["stream"] is False
    assert pb["kv_transfer_params"]["do_remote_decode"] is True
    tid = pb["kv_transfer_params"]["transfer_id"]
    assert len(tid) == 32 and int(tid, 16) >= 0
    assert set(pb["kv_transfer_params"]) == {"do_remote_decode", "transfer_id"}
    assert "conversation_id" not in pb

    (db,) = d.received
    assert db["kv_transfer_params"] == p.kv_params
    assert db == {"model": "tiny", "prompt": "hello", "max_tokens": 16, "temperature": 0,
                  "kv_transfer_params": p.kv_params}
    for hdrs in (p.headers[0], d.headers[0]):
        assert hdrs["authorization"] == "Bearer k"
        assert hdrs["x-request-id"] == tid
    assert r.headers["x-kvferry-prefill"].startswith("http://127.0.0.1:")
    assert r.headers["x-kvferry-decode"].startswith("http://127.0.0.1:")
    assert r.headers["x-kvferry-transfer-id"] == tid


def test_chat_prefill_leg(cluster: Callable[..., Cluster], client: httpx.Client) -> None:
    url, (p,), (d,) = cluster()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 20, "stream": True, "min_tokens": 2,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        text = r.read().decode()
    assert "tok3" in text and "[DONE]" in text
    (pb,) = p.received
    assert pb["max_tokens"] == 1 and pb["max_completion_tokens"] == 1
    assert pb["stream"] is False
    assert "stream_options" not in pb and "min_tokens" not in pb
    (db,) = d.received
    assert db["stream"] is True and db["stream_options"] == {"include_usage": True}
    assert db["max_completion_tokens"] == 20 and db["min_tokens"] == 2
    assert db["kv_transfer_params"] == p.kv_params


def test_stream_chunks_pass_through_as_they_arrive(
    cluster: Callable[..., Cluster], client: httpx.Client
) -> None:
    url, _, (d,) = cluster()
    d.chunks, d.chunk_delay_s = 4, 0.3
    body = {"model": "tiny", "prompt": "x", "stream": True}
    first_at = None
    parts = []
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for chunk in r.iter_bytes():
            if first_at is None:
                first_at = time.monotonic()
            parts.append(chunk)
    assert first_at is not None and first_at < d.chunk_sent_at[-1]
    text = b"".join(parts).decode()
    assert [f"tok{i}" in text for i in range(4)] == [True] * 4


def test_missing_kv_params_falls_back_to_recompute(
    cluster: Callable[..., Cluster], client: httpx.Client
) -> None:
    url, (p,), (d,) = cluster()
    p.kv_params = None
    r = client.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 200
    assert "kv_transfer_params" not in d.received[0]
    metrics = client.get(url + "/metrics").text
    assert "kvferry_router_prefill_missing_kv_params_total 1.0" in metrics


def test_prefill_down_is_502_fast(cluster: Callable[..., Cluster], client: httpx.Client) -> None:
    url, _, (d,) = cluster(p_urls=[closed_port_url()])
    t0 = time.monotonic()
    r = client.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert time.monotonic() - t0 < 3
    assert r.status_code == 502
    assert "prefill" in r.json()["error"]["message"]
    assert d.received == []


@pytest.mark.parametrize("stream", [False, True])
def test_decode_hang_is_504_within_timeout(
    cluster: Callable[..., Cluster], client: httpx.Client, stream: bool
) -> None:
    url, _, (d,) = cluster(decode_timeout_s=0.5)
    d.delay_s = 30
    t0 = time.monotonic()
    r = client.post(url + "/v1/completions",
                    json={"model": "tiny", "prompt": "x", "stream": stream})
    assert time.monotonic() - t0 < 3
    assert r.status_code == 504
    assert "decode" in r.json()["error"]["message"]
    health = client.get(url + "/health").json()
    assert health["decode"][0]["in_flight"] == 0


def test_upstream_status_mapping(cluster: Callable[..., Cluster], client: httpx.Client) -> None:
    url, (p,), (d,) = cluster()
    p.status = 404  # e.g. unknown model: P's answer passes through unchanged
    r = client.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["message"] == "p0 says 404"
    p.status = 500
    r = client.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 502 and "prefill" in r.json()["error"]["message"]
    p.status, d.status = 200, 503
    r = client.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 502 and "decode" in r.json()["error"]["message"]


def test_least_loaded_choice(cluster: Callable[..., Cluster], client: httpx.Client) -> None:
    url, ps, ds = cluster(n_p=2, n_d=2)
    body = {"model": "tiny", "prompt": "x"}
    seen = [client.post(url + "/v1/completions", json=body).headers for _ in range(4)]
    assert [h["x-kvferry-prefill"] for h in seen[:2]] == [h["x-kvferry-prefill"] for h in seen[2:]]
    assert seen[0]["x-kvferry-prefill"] != seen[1]["x-kvferry-prefill"]
    assert seen[0]["x-kvferry-decode"] != seen[1]["x-kvferry-decode"]

    # Hold one request on whichever D comes next; the next ones must avoid it.
    for d in ds:
        d.delay_s = 1.5
    slow: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: slow.update(r=client.post(url + "/v1/completions", json=body))
    )
    t.start()
    deadline = time.monotonic() + 5
    while sum(d.in_flight for d in ds) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    busy = next(d for d in ds if d.in_flight)
    for d in ds:
        d.delay_s = 0
    busy.delay_s = 1.5
    others = [client.post(url + "/v1/completions", json=body).headers["x-kvferry-decode"]
              for _ in range(3)]
    t.join()
    assert len(set(others)) == 1 and others[0] != slow["r"].headers["x-kvferry-decode"]


def test_models_proxied_from_decode(cluster: Callable[..., Cluster], client: httpx.Client) -> None:
    url, _, _ = cluster()
    r = client.get(url + "/v1/models")
    assert r.status_code == 200
    assert r.json()["data"][0]["owned_by"] == "d0"


def test_mode_selection(cluster: Callable[..., Cluster], client: httpx.Client) -> None:
    url, (p,), (d,) = cluster()
    body = {"model": "tiny", "prompt": "x"}
    r = client.post(url + "/v1/completions", json=body, headers={"x-kvferry-mode": "push"})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and msg == "push needs --prefill-kv for <engine>", msg
    r = client.post(url + "/v1/completions", json={**body, "kvferry_mode": "push"})
    assert r.status_code == 400
    r = client.post(url + "/v1/completions", json={**body, "kvferry_mode": "teleport"})
    assert r.status_code == 400
    r = client.post(url + "/v1/completions", content=b"{not json")
    assert r.status_code == 400
    assert p.received == [] and d.received == []


def test_client_disconnect_closes_upstream_stream(
    cluster: Callable[..., Cluster], client: httpx.Client
) -> None:
    url, _, (d,) = cluster()
    d.chunks, d.chunk_delay_s = 50, 0.1
    with client.stream("POST", url + "/v1/completions",
                       json={"model": "tiny", "prompt": "x", "stream": True}) as r:
        next(r.iter_bytes())
    assert d.stream_closed_early.wait(5)
    deadline = time.monotonic() + 3
    while client.get(url + "/health").json()["decode"][0]["in_flight"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_health_and_metrics(cluster: Callable[..., Cluster], client: httpx.Client) -> None:
    url, _, _ = cluster()
    assert client.get(url + "/health").json()["status"] == "ok"
    assert client.get(url + "/health", params={"deep": "true"}).status_code == 200
    client.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
    text = client.get(url + "/metrics").text
    assert 'kvferry_router_requests_total{endpoint="completions",mode="pull"} 1.0' in text
    assert "kvferry_router_ttft_seconds_count" in text
    assert "kvferry_router_upstream_in_flight" in text

    url2, _, _ = cluster(p_urls=[closed_port_url()])
    r = client.get(url2 + "/health", params={"deep": "true"})
    assert r.status_code == 503 and r.json()["prefill"][0]["healthy"] is False
