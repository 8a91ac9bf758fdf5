"""The decode step: D's leg, and its answer on the way to the client (JSON, or SSE passed
through chunk by chunk with engine-owned fields removed); a pull leg whose D refused the
connection goes to another D (`send_decode_or_next`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.responses import Response

from kvferry.connectors.protocol import timeline

from ..conversations.turn import Turn
from ..errors import RouterError, from_status, from_transport, never_sent
from ..fleet.upstreams import Upstream
from ..wire import bodies
from ..wire.answers import finish_json, kv_params_of
from ..wire.headers import HDR_DECODE, HDR_TRANSFER
from ..wire.sse import Leg, StreamEvents, UpstreamStream
from ..wire.sse_filters import EngineFieldFilter
from ..wire.stream_client import LegResponse, open_leg
from .context import TIMELINE, FlowContext, json_headers, passive, wire_failed
from .first_token import Head
from .migrate import Migration
from .observer import DecodeObserver, Observers
from .request import RouterRequest

log = logging.getLogger(__name__)


@dataclass
class DecodeLeg:
    """One decode leg to send: D's body, the headers of the client's answer, who follows
    the leg (notified in order), and for a stream its migration and P's token 1 (push)."""

    body: dict[str, Any]
    resp_headers: dict[str, str]
    observers: list[DecodeObserver] = field(default_factory=list)
    migration: Migration | None = None  # continues a stream whose D broke
    head: Head | None = None  # push: P's token 1, sent before D's if it comes first


def choose_decode(ctx: FlowContext, turn: Turn | None, broken: Collection[str] = ()) -> Upstream:
    """The conversation's D (where its KV is) unless gone or overloaded, else the least
    loaded; never one in `broken` (it failed this request already)."""
    if broken:
        return ctx.decode.choose(exclude=broken)
    return ctx.decode.choose_sticky(turn.entry.decode_url if turn and turn.entry else None)


async def send_decode(ctx: FlowContext, req: RouterRequest, leg: DecodeLeg, d: Upstream) -> Response:
    """Send the decode leg to `d` and hand its answer to the client (stream or JSON)."""
    body = leg.body
    if req.stream and leg.migration is not None:
        body = leg.migration.decode_body(body)
    resp_headers = {**leg.resp_headers, HDR_DECODE: d.url}
    obs = Observers(leg.observers)
    ctx.decode.acquire(d)
    handed_off = False
    try:
        try:
            resp = await open_leg(ctx.streams, ctx.client, d.url + req.path, bodies.encode(body),
                                  json_headers(req.headers), ctx.timeout("decode"))
        except httpx.HTTPError as exc:
            err = from_transport(exc, "decode", d.url)
            ctx.metrics.upstream_answers.labels(leg="decode", code="error").inc()
            wire_failed(ctx.decode, d, err)
            raise err from exc
        ctx.metrics.upstream_answers.labels(leg="decode", code=str(resp.status_code)).inc()
        passive(ctx.decode, d, resp.status_code < 500)
        try:
            if resp.status_code >= 400 or not req.stream:
                data = await resp.aread()
                if resp.status_code == 200 and (answered := obs.answered()) is not None:
                    await answered(data, kv_params_of(data))
            else:
                handed_off = True
                return _stream(ctx, req, resp, d, resp_headers, leg)
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
    if resp.status_code == 200:
        ctx.metrics.ttft.labels(endpoint=req.endpoint, stream="false").observe(
            time.perf_counter() - req.started
        )
        if (settle := obs.settle()) is not None:
            await settle()
        resp_headers = {**resp_headers, **obs.json_headers()}
    data = finish_json(data, {})
    return Response(
        data,
        status_code=resp.status_code,
        media_type=resp.headers.get("content-type", "application/json"),
        headers=resp_headers,
    )


async def send_decode_or_next(
    ctx: FlowContext,
    req: RouterRequest,
    d: Upstream,
    leg_for: Callable[[Upstream], DecodeLeg],
) -> Response:
    """`send_decode` on `d`; when `d` refused the connection (or did not accept it in
    time), the same leg on another healthy D, each D at most once per request.

    Safe because such a D got no byte of the request and the client none of the answer:
    a pull D READs P's blocks by P's signed offer, which names P (engine, address, blocks)
    and no D, so any D of the deployment may redeem it; the conversation's lease request
    names only a lease id. `leg_for(d)` builds the leg for the D that serves it (its
    observers commit to that D). A refusing D is ejected (`UpstreamPool.refused`) until a
    probe re-admits it.
    """
    tried: set[str] = set()
    while True:
        leg = leg_for(d)
        try:
            return await send_decode(ctx, req, leg, d)
        except RouterError as err:
            if not never_sent(err):
                raise
            tried.add(d.url)
            if leg.migration is not None:
                leg.migration.failed.add(d.url)  # nor for a later migration of the stream
            if ctx.decode.healthy_count(tried) == 0:
                raise
            nxt = ctx.decode.choose(exclude=tried)
            ctx.metrics.retries.labels(leg="decode", mode=req.mode).inc()
            log.warning("%s; the decode leg goes to %s", err.message, nxt.url)
            d = nxt


def _stream(
    ctx: FlowContext,
    req: RouterRequest,
    resp: LegResponse,
    d: Upstream,
    resp_headers: dict[str, str],
    leg: DecodeLeg,
) -> UpstreamStream:
    """Wrap D's open SSE response as the client's stream: engine-owned fields removed
    from every event, then the observers' own rewriting (push's report event); a break
    continues on another pair when `leg.migration` can. D is released when its leg
    closes."""

    head = leg.head if leg.migration is not None else None  # splicing needs its rewriter
    obs = Observers(leg.observers)

    def first_chunk() -> None:
        timeline.mark(TIMELINE, resp_headers.get(HDR_TRANSFER, ""), "d_first_byte")
        if head is None or head.sent_at is None:
            ctx.metrics.ttft.labels(endpoint=req.endpoint, stream="true").observe(
                time.perf_counter() - req.started)

    def on_error(err: RouterError) -> None:
        ctx.metrics.errors.labels(endpoint=req.endpoint, leg=err.leg, kind=err.kind).inc()

    mig = leg.migration
    if mig is None:
        scrub = EngineFieldFilter(obs.stream_params(), obs.stream_done())
        first = Leg(resp, d.url, scrub, on_close=lambda: ctx.decode.release(d))
    else:
        mig.on_stream_params, mig.on_stream_done = obs.stream_params(), obs.stream_done()
        mig.on_moved = obs.moved()
        first = mig.leg(resp, d)
    return UpstreamStream(
        first,
        leg="decode",
        headers=resp_headers,
        events=StreamEvents(first_chunk, on_error, abort=obs.ended(False),
                            success=obs.ended(True), before_done=obs.settle(),
                            rewrite=obs.chunk_filter(),
                            # in memory, a next turn waits for the commit itself (`begin`)
                            recorded=obs.recorded() if ctx.conversations is not None
                            and ctx.conversations.shared else None,
                            chunks=ctx.metrics.count_stream_chunks),
        resume=mig.resume if mig is not None else None,
        head=head,
    )
