"""A conversation turn served by the D that holds its history, from D's prefix cache.

`route_turn` applies `turn_policy` to one request (before any leg is sent) and, for a
``d_local`` turn, sends D the client's body with only a lease request in its
kv_transfer_params: a plain local request on D, whose prefix cache hits the blocks the
conversation's lease keeps there, so D computes only the new tokens. D's answer commits
like any turn's (`turns.TurnCommit`): D leases this turn's blocks under a new lease,
the entry is replaced and the previous lease released (the shared blocks stay, held by
the new lease), so the next turn finds the whole history on D again.

A D-local leg that fails before any byte reached the client falls back to P (counted as a
decode retry): the previous entry is untouched, so P may still read the history.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.responses import Response

from ..conversations.turn import Turn
from ..conversations.turn_policy import (
    Decision,
    Facts,
    LocalBudget,
    PolicyConfig,
    decide,
    new_tokens,
)
from ..errors import RouterError
from ..wire import bodies
from ..wire.headers import HDR_ROUTE, HDR_TRANSFER
from .context import FlowContext
from .decode import DecodeLeg, send_decode
from .request import RouterRequest
from .turns import turn_observers


def policy_of(ctx: FlowContext) -> tuple[PolicyConfig, LocalBudget]:
    """The app's policy settings and its per-D budget (made on first use)."""
    got = ctx.turn_policy
    if got is None:
        s = ctx.settings
        cfg = PolicyConfig(s.d_local_max_new_tokens, s.d_local_busy_tokens_per_s,
                           s.d_local_max_in_flight, s.d_local_chars_per_token)
        got = ctx.turn_policy = (cfg, LocalBudget(cfg.busy_tokens_per_s, cfg.burst))
    return got


def choose_route(ctx: FlowContext, turn: Turn | None, client_headers: Any,
                 now: float) -> Decision:
    """The policy's decision for this request, counted; takes D's budget if D-local."""
    cfg, budget = policy_of(ctx)
    entry = turn.entry if turn is not None else None
    if turn is None or entry is None:
        d = Decision("p_cold", "no_history" if turn is not None else "no_conversation")
    else:
        d_up = ctx.decode.choose_sticky(entry.decode_url)
        sticky = d_up.url == entry.decode_url
        n = (new_tokens(turn.view, entry.history, entry.num_tokens, entry.kv_transfer_params,
                        cfg.chars_per_token) if turn.view is not None else None)
        forced = str(client_headers.get(HDR_ROUTE, "")).strip().lower() == "prefill"
        d = decide(cfg, Facts(has_entry=True, sticky=sticky, new=n, d_in_flight=d_up.in_flight,
                              budget_ok=n is not None and budget.allows(d_up.url, n, now),
                              forced_prefill=forced))
        if d.route == "d_local" and n is not None:
            budget.take(d_up.url, n, now)
            ctx.metrics.d_local_tokens.inc(n)
    ctx.metrics.turn_routes.labels(route=d.route, reason=d.reason).inc()
    return d


async def route_turn(ctx: FlowContext, req: RouterRequest) -> Response | None:
    """D's answer for a D-local turn; None when the turn goes through P."""
    turn = req.turn
    decision = choose_route(ctx, turn, req.client_headers, time.monotonic())
    if decision.route != "d_local" or turn is None or turn.entry is None:
        return None
    d = ctx.decode.get(turn.entry.decode_url)
    if d is None:
        return None
    body = bodies.decode_body(req.body, turn.lease_request(ctx.settings.lease_ttl_s))
    resp_headers = {HDR_ROUTE: "d_local", HDR_TRANSFER: req.transfer_id}
    try:
        return await send_decode(ctx, req, DecodeLeg(body, resp_headers, turn_observers(ctx, turn, d)),
                                 d)
    except RouterError as err:
        if err.status < 500 or err.kind == "no_upstream":
            raise
        ctx.metrics.retries.labels(leg="decode", mode="d_local").inc()
        ctx.metrics.turn_routes.labels(route="p_reuse", reason="d_local_failed").inc()
        return None
