"""The request chain, top to bottom: a conversation turn, the prefill leg, then the
decode leg (pull, the default); push is its own module.

How a request flows (pull):

1. The client's body is sanitised: router-owned fields (`kv_transfer_params`,
   `kvferry_mode`, `conversation_id`) are removed and never forwarded.
2. The least-loaded P gets the same body with max_tokens=1 (and max_completion_tokens=1
   for chat), stream=false, no stream_options, and
   `kv_transfer_params={"do_remote_decode": true, "transfer_id": <uuid4 hex>}`
   (`prefill.py`; a P that fails is retried on another P). P computes the prompt's
   KV, keeps the blocks and answers with JSON whose top-level `kv_transfer_params` tells
   a decoder where to read them.
3. Only now is D chosen (least-loaded, so the choice sees the load at decode time). D gets
   the client's original body plus exactly P's returned `kv_transfer_params`; if P gave
   none, D gets none and recomputes (warning + metric). A D that refuses the connection
   is ejected and the same leg goes to another healthy D (`decode.send_decode_or_next`):
   P's offer names no D.
4. D's answer goes back to the client (`decode.py`): SSE passed through chunk by chunk,
   or JSON; from both, engine-owned fields (D's own `kv_transfer_params`, which vLLM 0.33
   also streams on the last chunk) are removed (`bodies.ENGINE_FIELDS`,
   `wire.sse_filters.EngineFieldFilter`).

Push (header `x-kvferry-mode: push` or body `kvferry_mode: "push"`): `push.py`.
A stream whose D breaks mid-way continues on another pair (`migrate.py`).
Conversations (`turns.py`): P is offered the previous turn's KV on D, and D's answer
commits this turn's lease. A short turn skips P: its D serves it from its own prefix
cache (`d_local.py`, policy in `conversations/turn_policy.py`).

Timing for benchmarks (operator token only, router/api/auth.py): answers carry
`x-kvferry-prefill-ms` (P leg duration). A push stream's headers leave before P is done,
so there it travels in an SSE comment before `data: [DONE]` (`wire.headers.report_comment`).

A request D would refuse is refused before P works (`wire/validate.py`); a pull D leg that
fails or is refused after P answered tells P to free its offer now (`offer_release.py`).
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.responses import Response

from ..errors import BROKE, RouterError
from ..wire import bodies, validate
from ..wire.answers import ms_str, passthrough
from ..wire.headers import (
    HDR_FIRST_TOKEN,
    HDR_PREFILL,
    HDR_PREFILL_MS,
    HDR_REUSE_REASON,
    HDR_REUSED,
    HDR_TRANSFER,
)
from .context import FlowContext, forward_headers
from .d_local import route_turn
from .decode import DecodeLeg, choose_decode, send_decode_or_next
from .migrate import Migration
from .offer_release import release_soon
from .prefill import Extras, build_legs, prefill_with_retry
from .push import run_push
from .request import RouterRequest
from .turns import reuse_report, turn_observers

__all__ = ["FlowContext", "build_legs", "forward_headers", "run_request"]

log = logging.getLogger(__name__)


async def run_request(ctx: FlowContext, req: RouterRequest) -> Response:
    """Serve one completions/chat request through P and D; raises RouterError on failure.
    `req` is built once where the request enters (`api.app`) and passed down: its turn is
    looked up here.

    A request whose D took it and dropped the connection before answering (it died) is
    served afresh by another pair, up to `max_migrations` times: no byte has reached the
    client (this raises before any response exists), and the new pair gets a new prefill
    and transfer (P's first offer may have been read and freed already, so it is never
    handed to another D). A stream that breaks later continues mid-way (`migrate.py`)."""
    turn = None
    if ctx.conversations is not None and ctx.settings.reuse_available:
        turn = await ctx.conversations.begin(req.body, req.client_headers)
        if turn is not None and turn.entry is not None and not ctx.decode.member(
                turn.entry.decode_url):
            # Its D left the pool: its KV is gone, P must not try to read it; recompute.
            ctx.metrics.stale_entries.inc()
            turn.entry = None
    req.turn = turn
    req.body = bodies.sanitize(req.body)
    req.stream = bodies.wants_stream(req.body)
    broken: set[str] = set()
    left = ctx.settings.max_migrations
    while True:
        try:
            return await _serve(ctx, req.next_pass(frozenset(broken)))
        except RouterError as err:
            if (err.leg != "decode" or err.kind != BROKE or err.upstream is None or left == 0
                    or ctx.decode.healthy_count(broken | {err.upstream}) == 0):
                raise
            left -= 1
            broken.add(err.upstream)
            if turn is not None and turn.entry is not None and turn.entry.decode_url in broken:
                turn.entry = None  # its history was on the D that broke
            ctx.metrics.migrations.labels(result="rerun").inc()
            log.warning("%s before answering; the request goes to another pair", err.message)


async def _serve(ctx: FlowContext, req: RouterRequest) -> Response:
    """One pass through a pair, on no D in `req.broken`."""
    turn, transfer_id = req.turn, req.transfer_id
    migration = Migration(ctx, req) if req.stream else None
    local = await route_turn(ctx, req)  # a short turn: its D, no P
    if local is not None:
        return local
    if req.mode == "push":
        return await run_push(ctx, req, migration,
                              first_from_p=req.client_headers.get(HDR_FIRST_TOKEN) != "decode")

    legs = build_legs("pull", req.endpoint, req.body, transfer_id,
                      extra=Extras(p=turn.prefill_params() if turn else None))
    p, p_resp, p_secs = await prefill_with_retry(ctx, req.path, legs.prefill_body, req.headers)
    resp_headers = {HDR_PREFILL: p.url, HDR_TRANSFER: transfer_id,
                    HDR_PREFILL_MS: ms_str(p_secs)}
    if p_resp.status_code != 200:
        # Client errors (unknown model, prompt too long...) are P's to explain.
        return passthrough(p_resp, resp_headers)
    try:
        p_json: Any = p_resp.json()
    except ValueError:  # malformed JSON, bad UTF-8 (both ValueErrors)
        p_json = None
    kv_params = bodies.extract_kv_params(p_json)
    if kv_params is None:
        ctx.metrics.missing_kv_params.inc()
        log.warning(
            "prefill %s returned no kv_transfer_params (transfer %s); decode will recompute",
            p.url, transfer_id,
        )
    else:
        reused = reuse_report(ctx, turn, kv_params)
        if reused is not None:
            resp_headers[HDR_REUSED], resp_headers[HDR_REUSE_REASON] = str(reused[0]), reused[1]
    offer = kv_params
    if (why := _too_long(ctx, req.endpoint, req.body, p_json)) is not None:
        release_soon(ctx, offer)  # D would refuse it: P's blocks go now
        raise RouterError(400, why, "invalid_request_error", "router", "invalid_request")
    if turn is not None:
        kv_params = {**(kv_params or {}), **turn.lease_request(ctx.settings.lease_ttl_s)}
    d_body = bodies.decode_body(req.body, kv_params)
    d = choose_decode(ctx, turn, req.broken)
    try:
        resp = await send_decode_or_next(ctx, req, d, lambda up: DecodeLeg(
            d_body, resp_headers, turn_observers(ctx, turn, up), migration))
    except BaseException:
        release_soon(ctx, offer)  # D failed (or the client left): no D will read the offer
        raise
    if resp.status_code >= 400:
        release_soon(ctx, offer)  # D refused the request
    return resp


def _too_long(ctx: FlowContext, endpoint: str, clean: dict[str, Any], p_json: Any) -> str | None:
    """vLLM's refusal when D would refuse prompt + max_tokens (engines that refuse rather
    than clamp: validate.py), now that P's answer says how long the prompt is."""
    limits = ctx.limits.known if ctx.limits is not None else None
    if limits is None or not limits.refuses_over_length or not isinstance(p_json, dict):
        return None
    prompt_tokens = (p_json.get("usage") or {}).get("prompt_tokens")
    if not isinstance(prompt_tokens, int):
        return None
    return validate.over_length(prompt_tokens, validate.max_tokens_of(endpoint, clean), limits)
