"""The request chain: prefill leg, then decode leg (pull); push is a hook.

How a request flows (pull, the default):

1. The client's body is sanitised: router-owned fields (`kv_transfer_params`,
   `kvferry_mode`, `conversation_id`) are removed and never forwarded.
2. The least-loaded P gets the same body with max_tokens=1 (and max_completion_tokens=1
   for chat), stream=false, no stream_options, and
   `kv_transfer_params={"do_remote_decode": true, "transfer_id": <uuid4 hex>}`.
   P computes the prompt's KV, keeps the blocks and answers with JSON whose top-level
   `kv_transfer_params` tells a decoder where to read them.
3. Only now is D chosen (least-loaded, so the choice sees the load at decode time). D gets
   the client's original body plus exactly P's returned `kv_transfer_params`; if P gave
   none, D gets none and recomputes (warning + metric).
4. D's answer goes back to the client: SSE passed through chunk by chunk, or JSON; from
   both, engine-owned fields (D's own `kv_transfer_params`, which vLLM 0.33 also streams
   on the last chunk) are removed (`bodies.ENGINE_FIELDS`, `sse.EngineFieldFilter`).

Push (header `x-kvferry-mode: push` or body `kvferry_mode: "push"`): D is chosen first,
then P; both legs are sent at once with one transfer_id. P gets
{"do_remote_decode", "push", "transfer_id"}; D gets {"do_remote_prefill", "push",
"transfer_id", "remote_host", "remote_port"} naming P's kvferry side channel
(RouterSettings.prefill_kv_addrs), where D registers its blocks and P writes into them.
Both legs carry the same `x-request-id`; with `prefill_engine_ids` set, D also gets P's
`remote_engine_id`, `tp_size` and `remote_request_id`, which is all vLLM's own
NixlPushConnector needs to be driven by this router too (benchmarks compare it side by
side).
The client gets D's answer; P's answer is awaited in the background. A failing P is only
logged and counted (D's connector falls back to recompute); a failing D or a client that
goes away cancels P.

Timing for benchmarks: pull responses carry `x-kvferry-prefill-ms` (P leg duration). In
push the headers leave before P is done, so the value travels in the body instead: a last
SSE event `data: {"choices": [], "kvferry_prefill_ms": ms}` before `data: [DONE]`, or a
top-level `kvferry_prefill_ms` field of a JSON answer (only when P has answered by then).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.responses import Response

from kvferry.connectors.protocol import params as kv
from kvferry.connectors.protocol import timeline

from . import bodies
from .conversations import Conversations, Turn
from .errors import RouterError, from_status, from_transport
from .metrics import RouterMetrics
from .settings import Mode, RouterSettings
from .sse import ChainedFilter, ChunkFilter, EngineFieldFilter, InsertBeforeDone, UpstreamStream
from .upstreams import Upstream, UpstreamPool
from .wire import (
    BODY_PREFILL_MS,
    BODY_REUSE_REASON,
    BODY_REUSED,
    HDR_DECODE,
    HDR_PREFILL,
    HDR_PREFILL_MS,
    HDR_REUSE_REASON,
    HDR_REUSED,
    HDR_TRANSFER,
)

log = logging.getLogger(__name__)

FORWARD_HEADERS = ("authorization",)
"""Client headers passed to the engines (engines may run with --api-key)."""

REUSE_REPORT = kv.REUSE_REPORT_KEYS
PROBE_TIMEOUT_S = 10.0


@dataclass
class FlowContext:
    """Everything the chain needs; one per router app."""

    client: httpx.AsyncClient
    settings: RouterSettings
    prefill: UpstreamPool
    decode: UpstreamPool
    metrics: RouterMetrics
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    conversations: Conversations | None = None

    def timeout(self, leg: str) -> httpx.Timeout:
        """Per-leg timeouts: connect is short; read bounds each wait for bytes.

        leg is "prefill", "decode" or "probe" (health and model listing: short).
        """
        reads = {"prefill": self.settings.prefill_timeout_s, "decode": self.settings.decode_timeout_s}
        read = reads.get(leg, PROBE_TIMEOUT_S)
        c = self.settings.connect_timeout_s
        return httpx.Timeout(connect=c, read=read, write=read, pool=c)


@dataclass(frozen=True)
class Legs:
    """The two request bodies of one client request.

    In pull mode `decode_body` is None: D's body depends on P's answer and is built by
    `bodies.decode_body` afterwards. In push mode both are final before dispatch.
    """

    mode: Mode
    transfer_id: str
    prefill_body: dict[str, Any]
    decode_body: dict[str, Any] | None


def build_legs(
    mode: Mode,
    endpoint: str,
    clean: dict[str, Any],
    transfer_id: str,
    prefill_kv: tuple[str, int] | None = None,
    p_extra: dict[str, Any] | None = None,
    d_extra: dict[str, Any] | None = None,
) -> Legs:
    """Build the leg bodies for `mode` from a sanitised client body.

    Push needs `prefill_kv`, the (host, port) of the chosen P's kvferry side channel: D
    registers its blocks there and the connectors match the two sides by transfer_id.
    `p_extra` / `d_extra` join the legs' kv_transfer_params (conversation reuse: D's
    lease offer for P, a lease request for D; pull adds `d_extra` after P answered).
    """
    if mode == "pull":
        p_params = {**bodies.pull_prefill_params(transfer_id), **(p_extra or {})}
        return Legs(mode, transfer_id, bodies.prefill_body(clean, endpoint, p_params), None)
    if prefill_kv is None:
        raise ValueError("push legs need the prefill side-channel address")
    host, port = prefill_kv
    p_params = {**kv.push_prefill_params(transfer_id), **(p_extra or {})}
    d_params = {**kv.push_decode_params(transfer_id, host, port), **(d_extra or {})}
    return Legs(
        mode,
        transfer_id,
        bodies.prefill_body(clean, endpoint, p_params),
        bodies.decode_body(clean, d_params),
    )


def forward_headers(client_headers: Any, transfer_id: str) -> dict[str, str]:
    """Headers for both legs: the client's auth plus one request id shared by P and D."""
    out = {k: client_headers[k] for k in FORWARD_HEADERS if k in client_headers}
    out["x-request-id"] = transfer_id
    return out


async def run_request(
    ctx: FlowContext,
    endpoint: str,
    path: str,
    body: dict[str, Any],
    client_headers: Any,
    mode: Mode,
) -> Response:
    """Serve one completions/chat request through P and D; raises RouterError on failure."""
    started = time.perf_counter()
    transfer_id = uuid.uuid4().hex
    turn = None
    if ctx.conversations is not None and ctx.settings.reuse_available:
        turn = await ctx.conversations.begin(body, client_headers)
        if turn is not None and turn.entry is not None and not ctx.decode.member(
                turn.entry.decode_url):
            # Its D left the pool: its KV is gone, P must not try to read it; recompute.
            ctx.metrics.stale_entries.inc()
            turn.entry = None
    clean = bodies.sanitize(body)
    stream = bodies.wants_stream(clean)
    headers = forward_headers(client_headers, transfer_id)
    if mode == "push":
        return await _run_push(ctx, endpoint, path, clean, transfer_id, headers, stream, started,
                               turn)

    legs = build_legs(mode, endpoint, clean, transfer_id,
                      p_extra=turn.prefill_params() if turn else None)
    p = ctx.prefill.choose()
    try:
        p_resp, p_secs = await _prefill(ctx, p, path, legs.prefill_body, headers)
    except RouterError as err:
        # Nothing reached the client yet: one more try on another P.
        other = _retry_target(ctx, p, err, "pull")
        if other is None:
            raise
        p = other
        p_resp, p_secs = await _prefill(ctx, p, path, legs.prefill_body, headers)
    resp_headers = {HDR_PREFILL: p.url, HDR_TRANSFER: transfer_id,
                    HDR_PREFILL_MS: _ms_str(p_secs)}
    if p_resp.status_code != 200:
        # Client errors (unknown model, prompt too long...) are P's to explain.
        return _passthrough(p_resp, resp_headers)
    try:
        p_json: Any = p_resp.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        p_json = None
    kv_params = bodies.extract_kv_params(p_json)
    if kv_params is None:
        ctx.metrics.missing_kv_params.inc()
        log.warning(
            "prefill %s returned no kv_transfer_params (transfer %s); decode will recompute",
            p.url, transfer_id,
        )
    else:
        reused = _reuse_report(ctx, turn, kv_params)
        if reused is not None:
            resp_headers[HDR_REUSED], resp_headers[HDR_REUSE_REASON] = str(reused[0]), reused[1]
    if turn is not None:
        kv_params = {**(kv_params or {}), **turn.lease_request(ctx.settings.lease_ttl_s)}
    d_body = bodies.decode_body(clean, kv_params)
    d = ctx.decode.choose_sticky(turn.entry.decode_url if turn and turn.entry else None)
    return await _decode(ctx, endpoint, path, d_body, headers, stream, started, resp_headers,
                         d, _commit_hooks(ctx, turn, d, DecodeHooks()))


def _reuse_report(ctx: FlowContext, turn: Turn | None, kv_params: dict[str, Any]
                  ) -> tuple[int, str] | None:
    """Pop P's report on D->P reuse from its params; count it. (Reused tokens, why: "ok",
    or e.g. "local_hit_covers" when P's own prefix cache already held the history), or
    None when there was no history to reuse."""
    report = {k: kv_params.pop(k) for k in REUSE_REPORT if k in kv_params}
    if turn is None or turn.entry is None or not report:
        return None
    n, reason = kv.read_reuse_report(report)
    ctx.metrics.reuse_turns.labels(reason=reason).inc()
    ctx.metrics.reused_tokens.inc(n)
    return n, reason


def _commit_hooks(ctx: FlowContext, turn: Turn | None, d: Upstream, hooks: DecodeHooks
                  ) -> DecodeHooks:
    """Record the turn's lease once D answered well (JSON: from its body; SSE: afterwards)."""
    conv = ctx.conversations
    if turn is None or conv is None:
        return hooks

    async def on_json(params: dict[str, Any] | None) -> None:
        if not conv.commit_offer(turn, d.url, kv.answered_lease(params)):
            conv.commit_later(turn, d.url)  # e.g. an engine that keeps params to itself
        await conv.settled(turn)  # recorded (shared state too) before the client has it

    streamed: dict[str, Any] = {}

    def on_stream_params(params: dict[str, Any]) -> None:
        streamed.update(params)

    committed: list[bool] = []

    def on_stream_end() -> None:
        # Once, at D's `[DONE]` (before the client has it, so that its next turn, sent the
        # moment the stream ends, finds the commit under way), else at a clean end. vLLM
        # 0.33 streams D's params on the last chunk; older versions do not, so the offer is
        # then fetched over the lease-control channel (D granted it when the request ended).
        if committed:
            return
        committed.append(True)
        if not (streamed and conv.commit_offer(turn, d.url, kv.answered_lease(streamed))):
            conv.commit_later(turn, d.url)

    hooks.on_d_params = on_json
    hooks.on_stream_params = on_stream_params
    hooks.on_stream_done = on_stream_end
    hooks.on_success = on_stream_end
    return hooks


def _retry_target(ctx: FlowContext, p: Upstream, err: RouterError, mode: str
                  ) -> Upstream | None:
    """Another P for a prefill leg that failed on `p` (wire or 5xx), or None."""
    if err.kind == "no_upstream" or err.status < 500:
        return None
    try:
        other = ctx.prefill.choose(exclude={p.url})
    except RouterError:
        return None
    ctx.metrics.retries.labels(leg="prefill", mode=mode).inc()
    log.warning("prefill %s failed (%s); retrying on %s", p.url, err.message, other.url)
    return other


def _passive(pool: UpstreamPool, up: Upstream, ok: bool) -> None:
    """Requests count toward an engine's health like probes do."""
    if ok:
        pool.answered(up)
    elif pool.failed(up):
        log.warning("%s %s ejected after %d failed requests", pool.role, up.url, up.failures)


async def _prefill(
    ctx: FlowContext, p: Upstream, path: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[httpx.Response, float]:
    """POST the prefill leg; returns P's response and the leg's duration in seconds.

    5xx and transport failures become RouterError(leg=prefill).
    """
    t0 = time.perf_counter()
    with ctx.prefill.lease(p):
        try:
            resp = await ctx.client.post(
                p.url + path, content=bodies.encode(body), headers=_json(headers),
                timeout=ctx.timeout("prefill"))
        except httpx.HTTPError as exc:
            _passive(ctx.prefill, p, False)
            raise from_transport(exc, "prefill", p.url) from exc
    secs = time.perf_counter() - t0
    ctx.metrics.prefill_seconds.observe(secs)
    _passive(ctx.prefill, p, resp.status_code < 500)
    if resp.status_code >= 500:
        raise from_status(resp.status_code, resp.text, "prefill", p.url)
    return resp, secs


async def _decode(
    ctx: FlowContext,
    endpoint: str,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
    stream: bool,
    started: float,
    resp_headers: dict[str, str],
    d: Upstream | None = None,
    hooks: DecodeHooks | None = None,
) -> Response:
    """Send the decode leg and hand its answer to the client (stream or JSON)."""
    hooks = hooks or DecodeHooks()
    d = d or ctx.decode.choose()
    resp_headers = {**resp_headers, HDR_DECODE: d.url}
    ctx.decode.acquire(d)
    handed_off = False
    try:
        req = ctx.client.build_request(
            "POST", d.url + path, content=bodies.encode(body), headers=_json(headers),
            timeout=ctx.timeout("decode"))
        try:
            resp = await ctx.client.send(req, stream=True)
        except httpx.HTTPError as exc:
            _passive(ctx.decode, d, False)
            raise from_transport(exc, "decode", d.url) from exc
        _passive(ctx.decode, d, resp.status_code < 500)
        try:
            if resp.status_code >= 400 or not stream:
                data = await resp.aread()
                if resp.status_code == 200 and hooks.on_d_params is not None:
                    await hooks.on_d_params(_kv_params_of(data))
            else:
                handed_off = True
                return _stream(ctx, endpoint, resp, d, started, resp_headers, hooks)
        except httpx.HTTPError as exc:
            raise from_transport(exc, "decode", d.url) from exc
        finally:
            if not handed_off:
                await resp.aclose()
    finally:
        if not handed_off:
            ctx.decode.release(d)

    if resp.status_code >= 500:
        raise from_status(resp.status_code, data.decode(errors="replace"), "decode", d.url)
    extra: dict[str, Any] = {}
    if resp.status_code == 200:
        ctx.metrics.ttft.labels(endpoint=endpoint, stream="false").observe(
            time.perf_counter() - started
        )
        extra = hooks.json_fields() if hooks.json_fields else {}
    data = _finish_json(data, extra)
    return Response(
        data,
        status_code=resp.status_code,
        media_type=resp.headers.get("content-type", "application/json"),
        headers=resp_headers,
    )


def _stream(
    ctx: FlowContext,
    endpoint: str,
    resp: httpx.Response,
    d: Upstream,
    started: float,
    resp_headers: dict[str, str],
    hooks: DecodeHooks,
) -> UpstreamStream:
    """Wrap D's open SSE response; the D lease ends when the stream closes."""

    def first_chunk() -> None:
        timeline.mark(log, resp_headers.get(HDR_TRANSFER, ""), "d_first_byte")
        ctx.metrics.ttft.labels(endpoint=endpoint, stream="true").observe(
            time.perf_counter() - started
        )

    def on_error(err: RouterError) -> None:
        ctx.metrics.errors.labels(endpoint=endpoint, leg=err.leg, kind=err.kind).inc()

    return UpstreamStream(
        resp,
        leg="decode",
        url=d.url,
        headers=resp_headers,
        on_first_chunk=first_chunk,
        on_close=lambda: ctx.decode.release(d),
        on_error=on_error,
        on_abort=hooks.on_abort,
        chunk_filter=_client_filter(hooks),
        on_success=hooks.on_success,
    )


def _client_filter(hooks: DecodeHooks) -> ChunkFilter:
    """What every D stream passes through on its way to the client: engine-owned fields
    removed first (always), then the hook's own rewriting (push's report event)."""
    scrub = EngineFieldFilter(hooks.on_stream_params, hooks.on_stream_done)
    return scrub if hooks.chunk_filter is None else ChainedFilter(scrub, hooks.chunk_filter)


@dataclass
class DecodeHooks:
    """Optional extras for the decode leg (push uses them; pull needs none).

    json_fields: extra top-level fields for a 200 JSON answer. chunk_filter: rewrites the
    SSE bytes (after engine-owned fields were removed). on_abort: called when a stream
    ends badly (client gone, D broke); on_success when it ends cleanly. on_d_params: D's
    kv_transfer_params of a JSON answer; on_stream_params: those a stream carried.
    """

    json_fields: Callable[[], dict[str, Any]] | None = None
    chunk_filter: ChunkFilter | None = None
    on_abort: Callable[[], None] | None = None
    on_success: Callable[[], None] | None = None  # stream ended cleanly
    on_d_params: Callable[[dict[str, Any] | None], Awaitable[None]] | None = None
    on_stream_params: Callable[[dict[str, Any]], None] | None = None  # D's streamed params
    on_stream_done: Callable[[], None] | None = None  # D's `[DONE]` is about to be forwarded

@dataclass
class PushPrefill:
    """The background P leg of one push request."""

    task: asyncio.Task[None] | None = None
    ms: float | None = None
    """P leg duration once P answered 200, else None."""
    reused: tuple[int, str] | None = None
    """(Tokens P read back from D, why) for conversation reuse, once P answered."""

    def cancel(self) -> None:
        """Abort P's request (closes its connection) unless it has finished."""
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def json_fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {} if self.ms is None else {BODY_PREFILL_MS: round(self.ms, 3)}
        if self.reused is not None:
            out[BODY_REUSED], out[BODY_REUSE_REASON] = self.reused
        return out

    def sse_event(self) -> bytes | None:
        fields = self.json_fields()
        if not fields:
            return None
        payload = json.dumps({"choices": [], **fields})
        return f"data: {payload}\n\n".encode()


async def _run_push(
    ctx: FlowContext,
    endpoint: str,
    path: str,
    clean: dict[str, Any],
    transfer_id: str,
    headers: dict[str, str],
    stream: bool,
    started: float,
    turn: Turn | None = None,
    exclude: frozenset[str] = frozenset(),
) -> Response:
    """Push: choose D, then P; send both legs at once; D's answer is the client's.

    A P leg that fails (wire or 5xx) before D answered is retried once: D's leg is
    cancelled and both legs go again, on another P. Once D answered, a failing P is logged
    and counted but D is left alone: its connector falls back (per
    kv_load_failure_policy) when P's write never comes. A failing D leg or a client that
    disconnects cancels the P leg.
    """
    d = ctx.decode.choose_sticky(turn.entry.decode_url if turn and turn.entry else None)
    p = ctx.prefill.choose(exclude=exclude)
    prefill_kv = ctx.settings.prefill_kv_addr(p.url)
    if prefill_kv is None:
        raise RouterError(400, f"push needs --prefill-kv for {p.url}", "invalid_request_error",
                          "router", "no_prefill_kv")
    d_extra = {**ctx.settings.push_identity(p.url, transfer_id),
               **(turn.lease_request(ctx.settings.lease_ttl_s) if turn else {})}
    legs = build_legs("push", endpoint, clean, transfer_id, prefill_kv,
                      p_extra=turn.prefill_params() if turn else None, d_extra=d_extra)
    assert legs.decode_body is not None
    leg = PushPrefill()
    p_failed: asyncio.Future[RouterError] = asyncio.get_running_loop().create_future()

    def failed(kind: str, detail: str) -> None:
        ctx.metrics.push_prefill_failures.labels(kind=kind).inc()
        log.warning("push prefill leg on %s failed (transfer %s): %s; decode %s falls back",
                    p.url, transfer_id, detail, d.url)

    async def prefill_leg() -> None:
        try:
            resp, secs = await _prefill(ctx, p, path, legs.prefill_body, headers)
        except RouterError as err:
            ctx.metrics.errors.labels(endpoint=endpoint, leg=err.leg, kind=err.kind).inc()
            failed(err.kind, err.message)
            if not p_failed.done():
                p_failed.set_result(err)
            return
        if resp.status_code != 200:
            failed(f"http_{resp.status_code}", f"HTTP {resp.status_code}: {resp.text[:300]}")
            return
        try:
            params = bodies.extract_kv_params(resp.json())
        except (json.JSONDecodeError, UnicodeDecodeError):
            params = None
        if params is not None:
            leg.reused = _reuse_report(ctx, turn, params)
        leg.ms = secs * 1000.0
        timeline.mark(log, transfer_id, "p_answered")

    timeline.mark(log, transfer_id, "dispatched")
    leg.task = asyncio.create_task(prefill_leg())
    ctx.background.add(leg.task)
    leg.task.add_done_callback(ctx.background.discard)
    # P's prefill is the critical path: let its request go out before D's is built.
    await asyncio.sleep(0)
    resp_headers = {HDR_PREFILL: p.url, HDR_TRANSFER: transfer_id}
    hooks = _commit_hooks(ctx, turn, d, DecodeHooks(
        json_fields=leg.json_fields, chunk_filter=InsertBeforeDone(leg.sse_event),
        on_abort=leg.cancel))
    d_leg = asyncio.create_task(_decode(ctx, endpoint, path, legs.decode_body, headers, stream,
                                        started, resp_headers, d, hooks))
    try:
        await asyncio.wait({d_leg, p_failed}, return_when=asyncio.FIRST_COMPLETED)
        if not d_leg.done() and not exclude:
            other = _retry_target(ctx, p, p_failed.result(), "push")
            if other is not None:  # D has answered nothing: start over with another P
                d_leg.cancel()
                await asyncio.gather(d_leg, return_exceptions=True)
                retry_id = uuid.uuid4().hex  # a fresh transfer: D's old one is cancelled
                return await _run_push(ctx, endpoint, path, clean, retry_id,
                                       {**headers, "x-request-id": retry_id}, stream, started,
                                       turn, exclude | {p.url})
        resp = await d_leg
    except BaseException:
        d_leg.cancel()
        leg.cancel()
        raise
    if not isinstance(resp, UpstreamStream) and resp.status_code != 200:
        leg.cancel()
    return resp


def _passthrough(resp: httpx.Response, headers: dict[str, str]) -> Response:
    """Return an upstream's non-2xx answer (status, body, content type) without
    engine-owned fields."""
    return Response(
        _finish_json(resp.content, {}),
        status_code=resp.status_code,
        media_type=resp.headers.get("content-type", "application/json"),
        headers=headers,
    )


def _json(headers: dict[str, str]) -> dict[str, str]:
    return {**headers, "content-type": "application/json"}


def _ms_str(secs: float) -> str:
    return f"{secs * 1000.0:.3f}"


def _kv_params_of(data: bytes) -> dict[str, Any] | None:
    try:
        return bodies.extract_kv_params(json.loads(data))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def _finish_json(data: bytes, extra: dict[str, Any]) -> bytes:
    """Drop engine-owned fields (D's block locations and lease) and add `extra` fields."""
    if not extra and not any(f'"{k}"'.encode() in data for k in bodies.ENGINE_FIELDS):
        return data
    try:
        obj = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return data
    if not isinstance(obj, dict):
        return data
    bodies.scrub_engine_fields(obj)
    obj.update(extra)
    return json.dumps(obj).encode()
