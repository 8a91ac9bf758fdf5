"""FastAPI app: the OpenAI-compatible front door of kvferry.

Endpoints: POST /v1/completions and /v1/chat/completions (prefill -> decode, see
kvferry.router.legs.flow), GET /v1/models (proxied from a decode engine), GET /health
(`?deep=true` also probes every engine), GET /metrics (Prometheus).
Per-request mode: header `x-kvferry-mode` or body field `kvferry_mode`, else the default.
Push needs the prefill engines' side-channel addresses (RouterSettings.prefill_kv_addrs).

Fleet (see `fleet.discovery`, `conversations.state`): conversation state in memory or Redis, engines from a
file as well as the static lists, health probes that eject and re-admit engines;
`server.serve` runs it and drains on SIGTERM (stops accepting, finishes in-flight streams,
bounded, exits 0).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp

from kvferry.connectors.protocol.params import SECRET_ENV, secret

from ..conversations.caller import is_operator
from ..conversations.front import Conversations, LeaseUnavailable
from ..conversations.registry import ConversationEntry
from ..errors import RouterError, error_body, from_status, from_transport
from ..fleet.discovery import Fleet
from ..fleet.engine_limits import LimitsWatch, body_limit
from ..fleet.kv_events import subscribe
from ..fleet.kv_index import PrefixIndex
from ..fleet.upstreams import UpstreamPool
from ..legs.context import FlowContext, forward_headers
from ..legs.flow import run_request
from ..legs.request import RouterRequest
from ..metrics import RouterMetrics
from ..settings import MODES, Mode, RouterSettings
from ..wire import bodies, validate
from ..wire.stream_client import StreamClient
from . import auth, intake
from .admission import Admission, AdmissionMiddleware
from .direct_routes import Handler, RouterApp, as_endpoint

log = logging.getLogger(__name__)

UPSTREAM_KEEPALIVE_S = 4.0
"""Idle engine connections are dropped after this, a second before the engines' own idle
close (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s; httpx defaults to 5 s too): a request
sent on a connection the engine is closing at that moment fails on the wire."""


def _bad_request(message: str) -> JSONResponse:
    return JSONResponse(error_body(message, 400, "invalid_request_error"), status_code=400)


def resolve_mode(settings: RouterSettings, header: str | None, body: dict[str, Any]) -> Mode:
    """Mode for one request; raises ValueError with a client-facing message."""
    raw = header or body.get("kvferry_mode") or settings.mode
    if raw not in MODES:
        raise ValueError(f"unknown mode {raw!r}; expected one of {', '.join(MODES)}")
    return raw  # type: ignore[return-value]


def create_app(settings: RouterSettings, secret_key: bytes | None = None) -> FastAPI:
    """Build a router app; the httpx client lives for the app's lifespan.

    ``secret_key`` (default: KVFERRY_SECRET) signs lease-control requests to the decode
    engines and salts tenant ids.
    """
    metrics = RouterMetrics()
    pool_kw: dict[str, Any] = {"allow_empty": settings.discovers,
                               "eject_after": settings.eject_after, "metrics": metrics,
                               "starting": settings.health_interval_s > 0}
    prefill = UpstreamPool("prefill", settings.prefill_urls, metrics.in_flight, **pool_kw)
    decode = UpstreamPool("decode", settings.decode_urls, metrics.in_flight, **pool_kw)
    fleet = Fleet(settings, prefill, decode, metrics)
    fleet.reload()  # the engines file's engines serve the very first request
    holder: dict[str, FlowContext] = {}
    key = secret() if secret_key is None else secret_key
    if settings.reuse_available and not key:
        # D checks every lease request's signature: without the deployment's secret
        # each one is refused and no conversation ever reuses D's KV.
        log.warning("%s is not set: decode engines will refuse this router's lease "
                    "requests, so conversation reuse is off; set it to the value the "
                    "engines run with", SECRET_ENV)
    conversations = Conversations(settings, metrics, key)
    kv_index = PrefixIndex(settings.kv_index_max_blocks) if settings.prefill_kv_events else None
    keys = auth.ApiKeys(settings.api_keys_file) if settings.api_keys_file else None
    gate = auth.Gate(keys, auth.operator_token(settings.operator_token,
                                               settings.operator_token_file))
    engine_limits = LimitsWatch(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(
            max_connections=settings.max_connections,
            max_keepalive_connections=settings.max_connections,
            keepalive_expiry=UPSTREAM_KEEPALIVE_S,
        )
        # trust_env=False: proxy variables must never divert engine traffic.
        async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
            holder["ctx"] = FlowContext(client, settings, prefill, decode, metrics,
                                        conversations=conversations, kv_index=kv_index,
                                        secret=key, limits=engine_limits)
            holder["ctx"].streams = StreamClient(settings.max_connections, UPSTREAM_KEEPALIVE_S)
            loops = [engine_limits.run(client, decode, holder["ctx"].timeout("probe"))]
            if settings.engines_file:
                loops.append(fleet.watch())
            if settings.prefill_dns or settings.decode_dns:
                loops.append(fleet.watch_dns())
            if settings.health_interval_s > 0:
                loops.append(fleet.probe_loop(client))
            if settings.state != "memory":
                loops.append(_every(5.0, conversations.refresh_size))
            if kv_index is not None:
                loops.append(subscribe(kv_index, metrics, dict(zip(
                    settings.prefill_urls, settings.prefill_kv_events, strict=True)),
                    {u: prefill.name_of(u) for u in settings.prefill_urls}))
            tasks = [asyncio.create_task(c) for c in loops]
            yield
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await conversations.close()
            pending = list(holder["ctx"].background)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await holder["ctx"].streams.close()

    app = RouterApp(title="kvferry router", lifespan=lifespan)
    admission = Admission(settings.max_active, settings.max_queued, settings.queue_timeout_s)

    def admitted(handler: Handler) -> ASGIApp:
        return AdmissionMiddleware(as_endpoint(handler), admission=admission,
                                   on_refused=lambda path, kind: metrics.errors.labels(
                                       endpoint=bodies.CHAT if "chat" in path
                                       else bodies.COMPLETIONS, leg="router", kind=kind).inc())

    app.state.settings = settings
    app.state.metrics = metrics
    app.state.conversations = conversations
    app.state.fleet = fleet
    app.state.draining = False
    app.state.pools = {"prefill": prefill, "decode": decode}
    app.state.kv_index = kv_index
    app.state.limits = engine_limits

    def refused(endpoint: str, kind: str, resp: Response) -> Response:
        metrics.errors.labels(endpoint=endpoint, leg="router", kind=kind).inc()
        return resp

    async def handle(request: Request, endpoint: str, path: str) -> Response:
        """Credentials, size, JSON, what D would refuse: all before any engine work."""
        ctx = holder["ctx"]
        received = time.perf_counter()  # TTFT counts the body's parsing too
        if (denied := gate.admit(request.headers)) is not None:
            return refused(endpoint, "unauthorized", denied)
        try:
            raw = await intake.read_capped(request, body_limit(settings, engine_limits.known))
        except intake.TooLarge as e:
            return refused(endpoint, "too_large", e.response())
        try:
            body = bodies.decode(raw)
        except ValueError:
            return _bad_request("request body must be JSON")
        if not isinstance(body, dict):
            return _bad_request("request body must be a JSON object")
        try:
            mode = resolve_mode(settings, request.headers.get("x-kvferry-mode"), body)
        except ValueError as exc:
            return refused(endpoint, "bad_mode", _bad_request(str(exc)))
        if (why := validate.refusal(endpoint, body, engine_limits.known)) is not None:
            return refused(endpoint, "invalid_request", _bad_request(why))
        metrics.requests.labels(endpoint=endpoint, mode=mode).inc()
        try:
            resp = await run_request(ctx, RouterRequest(endpoint, path, body, request.headers, mode,
                                                  received))
        except RouterError as err:
            metrics.errors.labels(endpoint=endpoint, leg=err.leg, kind=err.kind).inc()
            log.warning("request failed: %s", err.message)
            resp = err.response()
        auth.redact(resp.headers)
        resp.background = _Observe(resp.background, metrics.request_seconds.labels(
            endpoint=endpoint, code=str(resp.status_code)), received)
        return resp

    async def completions(request: Request) -> Response:
        return await handle(request, bodies.COMPLETIONS, "/v1/completions")

    async def chat_completions(request: Request) -> Response:
        return await handle(request, bodies.CHAT, "/v1/chat/completions")

    # The token path's endpoints: admitted, then served past FastAPI's layers. FastAPI
    # keeps them too, for its schema and a 405 to any other method.
    app.direct = {"/v1/completions": admitted(completions),
                  "/v1/chat/completions": admitted(chat_completions)}
    app.post("/v1/completions")(completions)
    app.post("/v1/chat/completions")(chat_completions)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """D serves the answers, so D's model list is the one clients must see."""
        if (denied := gate.admit(request.headers)) is not None:
            return denied
        ctx = holder["ctx"]
        try:
            d = decode.choose()
        except RouterError as err:
            return err.response()
        with decode.lease(d):
            try:
                resp = await ctx.client.get(
                    d.url + "/v1/models",
                    headers=forward_headers(request.headers, "models"),
                    timeout=ctx.timeout("probe"),
                )
            except httpx.HTTPError as exc:
                err = from_transport(exc, "decode", d.url)
                metrics.errors.labels(endpoint="models", leg=err.leg, kind=err.kind).inc()
                return err.response()
        if resp.status_code >= 500:
            return from_status(resp.status_code, resp.text, "decode", d.url).response()
        return Response(
            resp.content,
            status_code=resp.status_code,
            media_type=resp.headers.get("content-type", "application/json"),
        )

    @app.get("/health")
    async def health(request: Request, deep: bool = False) -> JSONResponse:
        """Router liveness (503 while draining). With the operator token: every engine's
        state, and with deep=true, 503 unless every engine's /health is 200 (without the
        token deep=true is 403: it makes the router probe every engine)."""
        gate.admit(request.headers, need_key=False)
        status = "draining" if app.state.draining else "ok"
        code = 503 if app.state.draining else 200
        if not is_operator():
            if deep:
                return JSONResponse(error_body("deep health needs the operator token", 403,
                                               "permission_error"), status_code=403)
            return JSONResponse({"status": status}, status_code=code)

        def view(pool: UpstreamPool) -> list[dict[str, Any]]:
            return [{"name": u.name, "url": u.url, "in_flight": u.in_flight,
                     "state": u.state}
                    for u in pool.upstreams]

        out: dict[str, Any] = {"status": status, "prefill": view(prefill), "decode": view(decode)}
        if app.state.draining or not deep:
            return JSONResponse(out, status_code=code)
        ctx = holder["ctx"]
        entries = out["prefill"] + out["decode"]

        async def probe(entry: dict[str, Any]) -> None:
            try:
                r = await ctx.client.get(entry["url"] + "/health", timeout=ctx.timeout("probe"))
                entry["healthy"] = r.status_code == 200
            except httpx.HTTPError:
                entry["healthy"] = False

        await asyncio.gather(*(probe(e) for e in entries))
        ok = all(e["healthy"] for e in entries)
        out["status"] = "ok" if ok else "degraded"
        return JSONResponse(out, status_code=200 if ok else 503)

    @app.get("/v1/kvferry/conversations/{conversation_id}")
    async def conversation(conversation_id: str, request: Request) -> JSONResponse:
        """This API key's conversation: how many of its tokens are cached, until when."""
        if (denied := gate.admit(request.headers)) is not None:
            return denied
        _, entry = await conversations.find(conversation_id, request.headers)
        if entry is None:
            return JSONResponse(error_body("no live lease for this conversation", 404,
                                           "not_found_error"), status_code=404)
        return JSONResponse(client_view(conversation_id, entry))

    @app.post("/v1/kvferry/conversations/{conversation_id}/heartbeat")
    async def heartbeat(conversation_id: str, request: Request, ttl: float | None = None
                        ) -> JSONResponse:
        """The conversation is still active: renew its lease on D."""
        if (denied := gate.admit(request.headers)) is not None:
            return denied
        try:
            entry = await conversations.heartbeat(conversation_id, request.headers, ttl)
        except LeaseUnavailable as e:
            return JSONResponse(error_body(f"lease not renewed: {e}", 503, "service_unavailable"),
                                status_code=503)
        if entry is None:
            return JSONResponse(error_body("no live lease for this conversation", 404,
                                           "not_found_error"), status_code=404)
        return JSONResponse(client_view(conversation_id, entry))

    @app.delete("/v1/kvferry/conversations/{conversation_id}")
    async def end_conversation(conversation_id: str, request: Request) -> JSONResponse:
        """End of conversation: D frees its blocks now instead of at lease expiry."""
        if (denied := gate.admit(request.headers)) is not None:
            return denied
        return JSONResponse({"released": await conversations.end(conversation_id,
                                                                 request.headers)})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


CLIENT_FIELDS = ("conversation_id", "cached_tokens", "expires_at")
"""All a tenant learns of its conversation. Where the KV lives (D's URL, engine id, lease
id, block ids, side-channel address) is the deployment's business: with a lease id a
client could renew or release leases on D's control channel if it ever reached it, and
engine addresses map the cluster for it."""


def client_view(conversation_id: str, entry: ConversationEntry) -> dict[str, Any]:
    """The conversation as its tenant sees it: tokens whose KV is held (the next turn may
    reuse up to that many), and when the hold ends (unix seconds) unless renewed."""
    return dict(zip(CLIENT_FIELDS, (conversation_id, entry.num_tokens, entry.expiry),
                    strict=True))


class _Observe:
    """A response's background task: records the request's end-to-end time once the
    server has sent the answer's last byte (stream or JSON), then runs ``then``."""

    def __init__(self, then: Any, hist: Any, started: float) -> None:
        self.then, self.hist, self.started = then, hist, started

    async def __call__(self) -> None:
        self.hist.observe(time.perf_counter() - self.started)
        if self.then is not None:
            await self.then()


async def _every(period_s: float, fn: Callable[[], Awaitable[None]]) -> None:
    while True:
        await fn()
        await asyncio.sleep(period_s)
