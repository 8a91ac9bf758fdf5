"""The decode step: D's leg, and its answer on the way to the client (JSON, or SSE passed
through chunk by chunk with engine-owned fields removed); a pull leg whose D refused the
connection goes to another D (`send_decode_or_next`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.responses import Response

from kvferry.connectors.protocol import timeline

from ..errors import RouterError, from_status, from_transport, never_sent
from ..fleet.upstreams import Upstream
from ..wire import bodies
from ..wire.answers import finish_json, kv_params_of
from ..wire.headers import HDR_DECODE, HDR_TRANSFER
from ..wire.sse import ChunkFilter, EngineFieldFilter, Leg, UpstreamStream
from ..wire.stream_client import LegResponse, open_leg
from .context import TIMELINE, FlowContext, json_headers, passive, wire_failed
from .first_token import Head
from .migrate import Migration

log = logging.getLogger(__name__)


@dataclass
class DecodeHooks:
    """Optional extras for the decode leg (push uses them; pull needs none).

    json_fields: extra top-level fields for a 200 JSON answer. chunk_filter: rewrites the
    SSE bytes (after engine-owned fields were removed). on_abort: called when a stream
    ends badly (client gone, D broke); on_success when it ends cleanly. on_d_params: D's
    kv_transfer_params of a JSON answer; on_stream_params: those a stream carried.
    """

    json_fields: Callable[[], dict[str, Any]] | None = None
    json_headers: Callable[[], dict[str, str]] | None = None  # headers of a 200 JSON answer
    chunk_filter: ChunkFilter | None = None
    on_abort: Callable[[], None] | None = None
    on_success: Callable[[], None] | None = None  # stream ended cleanly
    on_d_params: Callable[[dict[str, Any] | None], Awaitable[None]] | None = None
    on_stream_params: Callable[[dict[str, Any]], None] | None = None  # D's streamed params
    on_stream_done: Callable[[], None] | None = None  # D's `[DONE]` is about to be forwarded
    migration: Migration | None = None  # continues a stream whose D broke
    on_moved: Callable[[Upstream], None] | None = None  # the stream continues on this D
    on_answer: Callable[[bytes], None] | None = None  # a 200 JSON answer's bytes, before on_d_params
    before_json: Callable[[], Awaitable[None]] | None = None  # awaited before json_fields
    before_done: Callable[[], Awaitable[None]] | None = None  # awaited before a stream's [DONE]
    head: Head | None = None  # push: P's token 1, sent before D's if it comes first


def choose_decode(ctx: FlowContext, turn: Any, broken: Collection[str] = ()) -> Upstream:
    """The conversation's D (where its KV is) unless gone or overloaded, else the least
    loaded; never one in `broken` (it failed this request already)."""
    if broken:
        return ctx.decode.choose(exclude=broken)
    return ctx.decode.choose_sticky(turn.entry.decode_url if turn and turn.entry else None)


async def send_decode(
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
    if stream and hooks.migration is not None:
        body = hooks.migration.decode_body(body)
    resp_headers = {**resp_headers, HDR_DECODE: d.url}
    ctx.decode.acquire(d)
    handed_off = False
    try:
        try:
            resp = await open_leg(ctx.streams, ctx.client, d.url + path, bodies.encode(body),
                                  json_headers(headers), ctx.timeout("decode"))
        except httpx.HTTPError as exc:
            err = from_transport(exc, "decode", d.url)
            ctx.metrics.upstream_answers.labels(leg="decode", code="error").inc()
            wire_failed(ctx.decode, d, err)
            raise err from exc
        ctx.metrics.upstream_answers.labels(leg="decode", code=str(resp.status_code)).inc()
        passive(ctx.decode, d, resp.status_code < 500)
        try:
            if resp.status_code >= 400 or not stream:
                data = await resp.aread()
                if resp.status_code == 200 and hooks.on_answer is not None:
                    hooks.on_answer(data)
                if resp.status_code == 200 and hooks.on_d_params is not None:
                    await hooks.on_d_params(kv_params_of(data))
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
        if hooks.before_json is not None:
            await hooks.before_json()
        extra = hooks.json_fields() if hooks.json_fields else {}
        if hooks.json_headers is not None:
            resp_headers = {**resp_headers, **hooks.json_headers()}
    data = finish_json(data, extra)
    return Response(
        data,
        status_code=resp.status_code,
        media_type=resp.headers.get("content-type", "application/json"),
        headers=resp_headers,
    )


async def send_decode_or_next(
    ctx: FlowContext,
    endpoint: str,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
    stream: bool,
    started: float,
    resp_headers: dict[str, str],
    d: Upstream,
    hooks_for: Callable[[Upstream], DecodeHooks],
    mode: str,
) -> Response:
    """`send_decode` on `d`; when `d` refused the connection (or did not accept it in
    time), the same leg on another healthy D, each D at most once per request.

    Safe because such a D got no byte of the request and the client none of the answer:
    a pull D READs P's blocks by P's signed offer, which names P (engine, address, blocks)
    and no D, so any D of the deployment may redeem it; the conversation's lease request
    names only a lease id. `hooks_for(d)` builds the hooks for the D that serves the leg
    (commits go to that D). A refusing D is ejected (`UpstreamPool.refused`) until a probe
    re-admits it.
    """
    tried: set[str] = set()
    while True:
        hooks = hooks_for(d)
        try:
            return await send_decode(ctx, endpoint, path, body, headers, stream, started,
                                     resp_headers, d, hooks)
        except RouterError as err:
            if not never_sent(err):
                raise
            tried.add(d.url)
            if hooks.migration is not None:
                hooks.migration.failed.add(d.url)  # nor for a later migration of the stream
            if ctx.decode.healthy_count(tried) == 0:
                raise
            nxt = ctx.decode.choose(exclude=tried)
            ctx.metrics.retries.labels(leg="decode", mode=mode).inc()
            log.warning("%s; the decode leg goes to %s", err.message, nxt.url)
            d = nxt


def _stream(
    ctx: FlowContext,
    endpoint: str,
    resp: LegResponse,
    d: Upstream,
    started: float,
    resp_headers: dict[str, str],
    hooks: DecodeHooks,
) -> UpstreamStream:
    """Wrap D's open SSE response as the client's stream: engine-owned fields removed
    from every event, then the hook's own rewriting (push's report event); a break
    continues on another pair when `hooks.migration` can. D is released when its leg
    closes."""

    head = hooks.head if hooks.migration is not None else None  # splicing needs its rewriter

    def first_chunk() -> None:
        timeline.mark(TIMELINE, resp_headers.get(HDR_TRANSFER, ""), "d_first_byte")
        if head is None or head.sent_at is None:
            ctx.metrics.ttft.labels(endpoint=endpoint, stream="true").observe(
                time.perf_counter() - started)

    def on_error(err: RouterError) -> None:
        ctx.metrics.errors.labels(endpoint=endpoint, leg=err.leg, kind=err.kind).inc()

    mig = hooks.migration
    if mig is None:
        scrub = EngineFieldFilter(hooks.on_stream_params, hooks.on_stream_done)
        first = Leg(resp, d.url, scrub, on_close=lambda: ctx.decode.release(d))
    else:
        mig.on_stream_params, mig.on_stream_done = hooks.on_stream_params, hooks.on_stream_done
        mig.on_moved = hooks.on_moved
        first = mig.leg(resp, d)
    return UpstreamStream(
        first,
        leg="decode",
        headers=resp_headers,
        on_first_chunk=first_chunk,
        on_error=on_error,
        on_abort=hooks.on_abort,
        chunk_filter=hooks.chunk_filter,
        on_success=hooks.on_success,
        resume=mig.resume if mig is not None else None,
        before_done=hooks.before_done,
        head=head,
    )
