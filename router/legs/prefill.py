"""The prefill step: the leg bodies of one request, P's POST, and its retries on other Ps
when P failed before any byte reached the client.

Retries go to healthy Ps not yet tried by this request. A P that refused the connection
(or did not accept it in time) never saw the request: the leg moves on to the next P,
each P at most once. A P that did see it (5xx, a broken or timed-out answer) is retried
once only, on one other P: a prompt that makes engines fail must not go round the fleet.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import httpx

from kvferry.connectors.protocol import params as kv

from ..errors import RouterError, from_status, from_transport, never_sent
from ..fleet.kv_events import prompt_tokens
from ..fleet.kv_index import choose
from ..fleet.upstreams import Upstream
from ..settings import Mode
from ..wire import bodies
from ..wire.stream_client import Answer, fetch
from .context import FlowContext, json_headers, passive, wire_failed

log = logging.getLogger(__name__)


def choose_prefill(ctx: FlowContext, body: Mapping[str, Any],
                   exclude: Collection[str] = ()) -> Upstream:
    """The P for this prefill leg: for a prompt of token ids, the P with the least expected
    work (tokens it lacks plus `kv_aware_load_tokens` per request in flight, from the
    prefill engines' KV events: `kv_index.choose`); otherwise, or when no P holds any of
    it, the pool's least-loaded choice."""
    index = ctx.kv_index
    tokens = prompt_tokens(body) if index is not None else None
    if tokens is None:
        return ctx.prefill.choose(exclude=exclude)
    ups = {u.url: u for u in ctx.prefill.upstreams if u.url not in exclude}
    healthy = {url: u for url, u in ups.items() if u.healthy} or ups
    matched = {url: index.matched_tokens(url, tokens) for url in healthy}
    url = choose({url: u.in_flight for url, u in healthy.items()}, matched, len(tokens),
                 ctx.settings.kv_aware_load_tokens)
    if url is None:
        ctx.metrics.kv_aware_choices.labels(result="no_match").inc()
        return ctx.prefill.choose(exclude=exclude)
    ctx.metrics.kv_aware_choices.labels(result="match").inc()
    ctx.metrics.kv_aware_matched_tokens.inc(matched[url])
    return healthy[url]


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


class Extras(NamedTuple):
    """What joins the legs' kv_transfer_params: for P (conversation reuse: D's lease
    offer) and for D (a lease request; pull adds its own after P answered)."""

    p: dict[str, Any] | None = None
    d: dict[str, Any] | None = None


NO_EXTRAS = Extras()


def build_legs(
    mode: Mode,
    endpoint: str,
    clean: dict[str, Any],
    transfer_id: str,
    prefill_kv: tuple[str, int] | None = None,
    extra: Extras = NO_EXTRAS,
) -> Legs:
    """Build the leg bodies for `mode` from a sanitised client body.

    Push needs `prefill_kv`, the (host, port) of the chosen P's kvferry side channel: D
    registers its blocks there and the connectors match the two sides by transfer_id.
    """
    p_extra, d_extra = extra
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


async def post_prefill(
    ctx: FlowContext, p: Upstream, path: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[Answer | httpx.Response, float]:
    """POST the prefill leg; returns P's response and the leg's duration in seconds.

    5xx and transport failures become RouterError(leg=prefill).
    """
    t0 = time.perf_counter()
    with ctx.prefill.lease(p):
        try:
            resp = await fetch(ctx.streams, ctx.client, p.url + path, bodies.encode(body),
                               json_headers(headers), ctx.timeout("prefill"))
        except httpx.HTTPError as exc:
            err = from_transport(exc, "prefill", p.url)
            ctx.metrics.upstream_answers.labels(leg="prefill", code="error").inc()
            wire_failed(ctx.prefill, p, err)
            raise err from exc
    secs = time.perf_counter() - t0
    ctx.metrics.upstream_answers.labels(leg="prefill", code=str(resp.status_code)).inc()
    ctx.metrics.prefill_seconds.observe(secs)
    passive(ctx.prefill, p, resp.status_code < 500)
    if resp.status_code >= 500:
        raise from_status(resp.status_code, resp.text, "prefill", p.url)
    return resp, secs


async def prefill_with_retry(
    ctx: FlowContext, path: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[Upstream, Answer | httpx.Response, float]:
    """Pull's P leg on the least-loaded P, retried on other Ps when it failed (wire or 5xx:
    nothing reached the client yet; see the module docstring for how often). Returns (P,
    its answer, seconds)."""
    p = choose_prefill(ctx, body)  # the P holding most of the prompt, if known
    tried: set[str] = set()
    seen_by_p = False  # a P got the request and failed: its one retry is spent
    while True:
        try:
            resp, secs = await post_prefill(ctx, p, path, body, headers)
            return p, resp, secs
        except RouterError as err:
            tried.add(p.url)
            if not never_sent(err):
                if seen_by_p:
                    raise
                seen_by_p = True
            other = retry_target(ctx, p, err, "pull", tried)
            if other is None:
                raise
            p = other


def retry_target(ctx: FlowContext, p: Upstream, err: RouterError, mode: str,
                 tried: set[str] | frozenset[str] = frozenset()) -> Upstream | None:
    """A healthy P, neither `p` nor in `tried`, for a prefill leg that failed on `p` (wire
    or 5xx), or None; counts the retry."""
    if err.kind == "no_upstream" or err.status < 500:
        return None
    exclude = {*tried, p.url}
    if ctx.prefill.healthy_count(exclude) == 0:
        return None
    other = ctx.prefill.choose(exclude=exclude)
    ctx.metrics.retries.labels(leg="prefill", mode=mode).inc()
    log.warning("prefill %s failed (%s); retrying on %s", p.url, err.message, other.url)
    return other
