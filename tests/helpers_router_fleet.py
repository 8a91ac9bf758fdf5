"""What the router fleet tests share (tests/test_router_fleet_*.py): a real Redis per module,
flushed per test; the signing secret D's keeper uses (autouse); an ExitStack; a router
served over real HTTP; one conversation turn; a fake P and a leasing D.

A test module takes a fixture by naming it at module level (``stack = helpers_router_fleet.stack``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fleet_stack import RedisServer
from helpers_fleet import AUTH, KEY, P_PARAMS, LeasingD
from helpers_http import OPERATOR, FakeEngine, serve

from kvferry.connectors.protocol.params import SECRET_ENV
from kvferry.router.api.app import create_app
from kvferry.router.settings import RouterSettings


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
    return httpx.post(url + "/v1/completions", json=body, headers={**AUTH, **OPERATOR}, timeout=10,
                      trust_env=False)


@pytest.fixture
def pd(stack: ExitStack) -> tuple[FakeEngine, LeasingD, str, str]:
    p, d = FakeEngine("p0", kv_params=dict(P_PARAMS)), LeasingD()
    stack.callback(d.server.close)
    purl, durl = (stack.enter_context(serve(e.app())) for e in (p, d.engine))
    return p, d, purl, durl
