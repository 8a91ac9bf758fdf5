"""`RouterApp.direct`: the completions endpoints served past FastAPI's layers (issue 33),
while every other request still goes through them."""

from __future__ import annotations

import asyncio
from contextlib import ExitStack

import httpx
from fastapi import Request, Response
from helpers_http import FakeEngine, serve
from starlette.types import ASGIApp, Receive, Scope, Send

from kvferry.router.api.app import create_app
from kvferry.router.api.direct_routes import RouterApp, as_endpoint
from kvferry.router.settings import RouterSettings


class Passes:
    """A FastAPI middleware that counts the requests that reach it."""

    seen: list[str] = []

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            Passes.seen.append(f"{scope['method']} {scope['path']}")
        await self.app(scope, receive, send)


def _call(app: ASGIApp, method: str, path: str, body: bytes = b"") -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            return await c.request(method, path, content=body)

    return asyncio.run(go())


def test_direct_posts_skip_the_framework_and_the_rest_does_not() -> None:
    Passes.seen = []

    async def echo(request: Request) -> Response:
        return Response(b"direct:" + await request.body(), media_type="text/plain")

    async def boom(_: Request) -> Response:
        raise RuntimeError("handler failed")

    app = RouterApp()
    app.add_middleware(Passes)
    app.direct = {"/v1/completions": as_endpoint(echo), "/v1/boom": as_endpoint(boom)}
    app.get("/health")(lambda: {"status": "ok"})
    app.post("/v1/completions")(echo)

    r = _call(app, "POST", "/v1/completions", b"{}")
    assert (r.status_code, r.content) == (200, b"direct:{}")
    assert Passes.seen == []  # not through FastAPI's stack
    assert _call(app, "GET", "/health").json() == {"status": "ok"}
    assert _call(app, "GET", "/v1/completions").status_code == 405
    assert Passes.seen == ["GET /health", "GET /v1/completions"]
    # a handler that raises before answering: the server's 500, as with the framework
    assert _call(app, "POST", "/v1/boom").status_code == 500


def test_the_router_app_serves_completions_directly_and_refuses_other_methods() -> None:
    with ExitStack() as stack:
        p = FakeEngine("p0", kv_params={"remote_block_ids": [1], "remote_engine_id": "p0"})
        d = FakeEngine("d0")
        purl, durl = (stack.enter_context(serve(e.app())) for e in (p, d))
        app = create_app(RouterSettings(prefill_urls=[purl], decode_urls=[durl],
                                        health_interval_s=0))
        assert isinstance(app, RouterApp)
        assert set(app.direct) == {"/v1/completions", "/v1/chat/completions"}
        url = stack.enter_context(serve(app))
        r = httpx.post(url + "/v1/completions", trust_env=False,
                       json={"model": "m", "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"]
        assert len(p.received) == len(d.received) == 1  # through P and D, on the direct path
        r = httpx.post(url + "/v1/completions", content=b"not json", trust_env=False)
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        assert httpx.get(url + "/v1/chat/completions", trust_env=False).status_code == 405
        assert httpx.get(url + "/health", trust_env=False).json() == {"status": "ok"}
