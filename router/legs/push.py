"""Push mode: D is chosen first, then P; both legs go out at once with one transfer id.

P gets {"do_remote_decode", "push", "transfer_id"}; D gets {"do_remote_prefill", "push",
"transfer_id", "remote_host", "remote_port"} naming P's kvferry side channel
(RouterSettings.prefill_kv_addrs), where D registers its blocks and P writes into them.
Both legs carry the same `x-request-id`; with `prefill_engine_ids` set, D also gets P's
`remote_engine_id`, `tp_size` and `remote_request_id`, which is all vLLM's own
NixlPushConnector needs to be driven by this router too (benchmarks compare it side by
side). The client gets D's answer; P's answer is awaited in the background.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.responses import Response

from kvferry.connectors.protocol import timeline

from ..conversations.caller import is_operator
from ..errors import RouterError, never_sent
from ..fleet.upstreams import Upstream
from ..wire import bodies
from ..wire.answers import ms_str
from ..wire.headers import (
    BODY_PREFILL_MS,
    BODY_REUSE_REASON,
    BODY_REUSED,
    HDR_PREFILL,
    HDR_PREFILL_MS,
    HDR_REUSE_REASON,
    HDR_REUSED,
    HDR_TRANSFER,
    report_comment,
)
from ..wire.sse import UpstreamStream
from ..wire.sse_filters import InsertBeforeDone
from . import first_token
from .context import TIMELINE, FlowContext
from .decode import DecodeLeg, choose_decode, send_decode_or_next
from .migrate import Migration
from .observer import DecodeObserver
from .offer_release import abort_push_soon
from .prefill import Extras, build_legs, choose_prefill, post_prefill, retry_target
from .request import RouterRequest
from .turns import reuse_report, turn_observers

log = logging.getLogger(__name__)

@dataclass
class PushPrefill(DecodeObserver):
    """The background P leg of one push request; it follows D's leg (`observer`): its
    report joins D's answer, and D's leg ending badly cancels it."""

    task: asyncio.Task[None] | None = None
    ms: float | None = None
    """P leg duration once P answered 200, else None."""
    reused: tuple[int, str] | None = None
    """(Tokens P read back from D, why) for conversation reuse, once P answered."""
    wait_s: float = 2.0
    """RouterSettings.push_report_wait_s"""
    answer: Any = None
    """P's parsed JSON answer (200), once it came."""
    operator: bool = False
    """The caller may see P's time (router/api/auth.py)."""

    def __post_init__(self) -> None:
        self.chunk_filter = InsertBeforeDone(self.sse_report)

    def ended(self, clean: bool) -> None:
        if not clean:
            self.cancel()  # the client left or D broke: P's leg goes too

    async def p_answer(self) -> Any:
        """P's answer once its leg ended (None: it failed or carried none)."""
        if self.task is not None:
            await asyncio.wait({self.task})  # never raises for it
        return self.answer

    def cancel(self) -> None:
        """Abort P's request (closes its connection) unless it has finished."""
        if self.task is not None and not self.task.done():
            self.task.cancel()

    async def settle(self) -> None:
        """Wait (up to `wait_s`) for P's answer before D's JSON answer, or the
        `[DONE]` of D's stream, goes out.

        D answers once P's WRITE landed, so P's prefill is over and its HTTP answer is on
        its way; but the router may read D's answer first (seen in CI: a reuse turn
        reported 0 reused tokens while P had read 256 back). Without this wait the P
        fields (reused tokens, P's time) would be missing from such an answer."""
        if self.task is None or self.task.done():
            return
        await asyncio.wait({self.task}, timeout=self.wait_s)  # never raises for it

    def json_headers(self) -> dict[str, str]:
        """A JSON answer's report: its headers leave after P answered, so the pull ones
        (P's time only for operators: `auth.redact`)."""
        out = {} if self.ms is None else {HDR_PREFILL_MS: ms_str(self.ms / 1000.0)}
        if self.reused is not None:
            out[HDR_REUSED], out[HDR_REUSE_REASON] = str(self.reused[0]), self.reused[1]
        return out

    def sse_report(self) -> bytes | None:
        """A stream's report: one SSE comment before `[DONE]` (no event vLLM would not
        send); P's time only for operators."""
        fields: dict[str, Any] = {}
        if self.ms is not None and self.operator:
            fields[BODY_PREFILL_MS] = round(self.ms, 3)
        if self.reused is not None:
            fields[BODY_REUSED], fields[BODY_REUSE_REASON] = self.reused
        return report_comment(fields) if fields else None


async def run_push(
    ctx: FlowContext,
    req: RouterRequest,
    migration: Migration | None = None,
    prefill: Upstream | None = None,
    exclude: frozenset[str] = frozenset(),
    first_from_p: bool = True,
) -> Response:
    """Push: choose D, then P (`prefill` when a retry already chose it); send both legs
    at once; D's answer is the client's.

    A P leg that fails (wire or 5xx) before D answered is retried: D's leg is cancelled
    and both legs go again, on another healthy P; once, unless P refused the connection
    (it never saw the request): then on every P not yet tried, each at most once. Once D
    answered, a failing P is logged and counted but D is left alone: its connector falls
    back (per kv_load_failure_policy) when P's write never comes. A D that refused the
    connection (it never saw the leg) is replaced by another healthy D, each at most once
    (`send_decode_or_next`). A D leg that fails otherwise, or a client that disconnects,
    cancels the P leg.
    """
    turn, endpoint, transfer_id = req.turn, req.endpoint, req.transfer_id
    d = choose_decode(ctx, turn, req.broken)
    p = prefill or choose_prefill(ctx, req.body, exclude)
    prefill_kv = ctx.settings.prefill_kv_addr(p.url)
    if prefill_kv is None:
        raise RouterError(400, f"push needs --prefill-kv for {p.url}", "invalid_request_error",
                          "router", "no_prefill_kv")
    d_extra = {**ctx.settings.push_identity(p.url, transfer_id),
               **(turn.lease_request(ctx.settings.lease_ttl_s) if turn else {})}
    legs = build_legs("push", endpoint, req.body, transfer_id, prefill_kv,
                      Extras(p=turn.prefill_params() if turn else None, d=d_extra))
    assert legs.decode_body is not None
    d_body = legs.decode_body
    first = "not asked" if not (req.stream and migration and first_from_p) else \
        first_token.why_not(endpoint, req.body, migration.why_not, ctx.settings)
    if first is None:  # P's token 1 goes first
        legs.prefill_body["return_token_ids"] = True
    leg = PushPrefill(wait_s=ctx.settings.push_report_wait_s, operator=is_operator())
    p_failed: asyncio.Future[RouterError] = asyncio.get_running_loop().create_future()

    def failed(kind: str, detail: str) -> None:
        ctx.metrics.push_prefill_failures.labels(kind=kind).inc()
        log.warning("push prefill leg on %s failed (transfer %s): %s; decode %s falls back",
                    p.url, transfer_id, detail, d.url)

    async def prefill_leg() -> None:
        try:
            resp, secs = await post_prefill(ctx, p, req.path, legs.prefill_body, req.headers)
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
            leg.answer = msgspec.json.decode(resp.content)
        except msgspec.DecodeError:
            leg.answer = None
        params = bodies.extract_kv_params(leg.answer) if leg.answer is not None else None
        if params is not None:
            leg.reused = reuse_report(ctx, turn, params)
        leg.ms = secs * 1000.0
        timeline.mark(TIMELINE, transfer_id, "p_answered")

    if timeline.ENABLED:  # the request's arrival, on the wall clock the marks use
        timeline.mark(TIMELINE, transfer_id, "router_in",
                      time.time() - (time.perf_counter() - req.started))
    timeline.mark(TIMELINE, transfer_id, "dispatched")
    leg.task = asyncio.create_task(prefill_leg())
    ctx.background.add(leg.task)
    leg.task.add_done_callback(ctx.background.discard)
    # P's prefill is the critical path: let its request go out before D's is built.
    await asyncio.sleep(0)
    resp_headers = {HDR_PREFILL: p.url, HDR_TRANSFER: transfer_id}

    def head() -> first_token.Head | None:
        if first is not None or migration is None:
            return None

        def sent() -> None:
            timeline.mark(TIMELINE, transfer_id, "p_token_out")
            ctx.metrics.ttft.labels(endpoint=endpoint, stream="true").observe(
                time.perf_counter() - req.started)

        return first_token.Head(
            endpoint, leg.p_answer, lambda t: migration.splice(t.token_id, t.text),
            lambda result: ctx.metrics.first_token.labels(result=result).inc(), sent)

    def leg_for(dd: Upstream) -> DecodeLeg:
        return DecodeLeg(d_body, resp_headers,
                         [*turn_observers(ctx, turn, dd), leg], migration, head())

    # A D that refuses the connection never saw the leg: another D may register with P
    # for the same transfer (D's body names P and the transfer, no D).
    d_leg = asyncio.create_task(send_decode_or_next(ctx, req, d, leg_for))
    try:
        await asyncio.wait({d_leg, p_failed}, return_when=asyncio.FIRST_COMPLETED)
        if not d_leg.done() and (not exclude or never_sent(p_failed.result())):
            other = retry_target(ctx, p, p_failed.result(), "push", exclude)
            if other is not None:  # D has answered nothing: start over with another P
                d_leg.cancel()
                await asyncio.gather(d_leg, return_exceptions=True)
                retry = req.with_transfer(uuid.uuid4().hex)  # D's old transfer is cancelled
                return await run_push(ctx, retry, migration, other, exclude | {p.url},
                                      first_from_p)
        resp = await d_leg
    except BaseException:
        d_leg.cancel()
        leg.cancel()
        abort_push_soon(ctx, p.url, transfer_id)  # no D will register: P frees its blocks
        raise
    if not isinstance(resp, UpstreamStream) and resp.status_code != 200:
        leg.cancel()
        abort_push_soon(ctx, p.url, transfer_id)  # D refused the request
    return resp
