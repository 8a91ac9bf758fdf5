"""KV-aware prefill choice on real vLLM CPU engines: 2 P (prefix caching on, publishing
their KV cache events over ZMQ) + 1 D behind the router, which subscribes.

A prompt that extends one already prefilled goes to the P holding that prefix, several
times in a row (least-loaded rotation alone would alternate), and that P's prefix cache
serves it; outputs equal a colocated run (D alone, so no P's cache is touched by it).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import httpx
import pytest
from fastapi import FastAPI
from helpers_http import OPERATOR, engine_name, free_port, serve
from stack import (
    ROUTERS,
    STARTUP_S,
    Engine,
    assert_no_engine_fields,
    assert_same_output,
    complete,
    kvferry_router_settings,
    prompt,
    start_engine,
    wait_until,
    warm_up,
)

from kvferry.router.api.app import create_app
from kvferry.scripts.engines import available_cpus
from kvferry.scripts.procs import stop_all, wait_healthy

pytestmark = pytest.mark.engine

BS = 128
EXTRA = {"handshake_timeout_s": 30, "recv_timeout_s": 60, "send_timeout_s": 90}


@dataclass
class Cluster:
    prefills: list[Engine]
    decode: Engine
    app: FastAPI
    url: str
    model: str

    def held(self, p: Engine, toks: list[int]) -> int:
        """Tokens of `toks` the router believes `p` holds (from p's events)."""
        return self.app.state.kv_index.matched_tokens(p.url, toks)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    from kvferry.scripts.modelgen import write_model

    model = str(write_model(tmp_path_factory.mktemp("model") / "tiny", "tiny", weights=True))
    logs = tmp_path_factory.mktemp("logs")
    secret = secrets.token_hex(16)
    cpus = available_cpus()
    with ExitStack() as es:
        children: list = []
        es.callback(stop_all, children)
        ports = [free_port(), free_port()]
        ps = []
        for cpu, port in zip((cpus[0], cpus[0]), ports, strict=True):  # CORE_RULE
            events = {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"tcp://*:{port}"}
            ps.append(start_engine("prefill", model, logs, secret, extra=EXTRA, cpus=(cpu,),
                                   engine_args=("--kv-events-config", json.dumps(events))))
        d = start_engine("decode", model, logs, secret, extra=EXTRA, cpus=(cpus[-1],))
        children += [e.child for e in (*ps, d)]
        wait_healthy(children, STARTUP_S)
        warm_up([*ps, d], model)
        settings = kvferry_router_settings(ps, [d], prefill_timeout_s=300, decode_timeout_s=300,
                                           prefill_kv_events=[f"tcp://127.0.0.1:{p}" for p in ports])
        app = create_app(settings, secret.encode())
        url = es.enter_context(serve(app))
        ROUTERS.add(url)
        yield Cluster(ps, d, app, url, model)


def send(c: Cluster, toks: list[int]) -> tuple[dict, str]:
    body = {"model": c.model, "prompt": toks, "max_tokens": 12, "temperature": 0,
            "logprobs": 5, "return_token_ids": True}
    r = httpx.post(c.url + "/v1/completions", json=body, timeout=300, headers=OPERATOR)
    r.raise_for_status()
    assert_no_engine_fields(r.text)
    return r.json(), r.headers["x-kvferry-prefill"]


def engine(c: Cluster, url: str) -> Engine:
    return next(p for p in c.prefills if p.url == url)


def hits(p: Engine) -> float:
    return p.metric("vllm:prefix_cache_hits_total")


def metric(c: Cluster, name: str, **labels: str) -> float:
    return c.app.state.metrics.registry.get_sample_value(name, labels or None) or 0.0


def test_turns_land_on_the_prefill_holding_their_prefix(cluster: Cluster):
    c = cluster
    homes = {}
    for seed in (1, 2):  # two histories, spread by load (no P holds either yet)
        toks = prompt(600, seed)
        resp, home = send(c, toks)
        assert_same_output(resp, complete(c.decode.url, c.model, toks))
        p = engine(c, home)
        wait_until(lambda p=p, toks=toks: c.held(p, toks) == 4 * BS, 30,
                   f"the router to learn what {home} holds")
        homes[seed] = (toks, p)
    assert metric(c, "kvferry_router_kv_aware_choices_total", result="no_match") >= 2
    for seed, (toks, p) in homes.items():
        for i in range(3):  # three extensions in a row: each on the P holding the prefix
            ext = toks + prompt(40 + i, 100 * seed + i)
            before = hits(p)
            resp, where = send(c, ext)
            assert where == p.url, f"extension {i} of history {seed} went to {where}"
            assert hits(p) - before >= 4 * BS  # served from that P's prefix cache
            assert_same_output(resp, complete(c.decode.url, c.model, ext))
    assert metric(c, "kvferry_router_kv_aware_choices_total", result="match") == 6
    assert metric(c, "kvferry_router_kv_aware_matched_tokens_total") >= 6 * 4 * BS
    for p in c.prefills:
        assert metric(c, "kvferry_router_kv_events_total", prefill=engine_name(c.url, p.url),
                      result="ok") > 0
