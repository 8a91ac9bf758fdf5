"""Mid-stream migration: when D's stream breaks after tokens reached the client, continue
it on another engine pair so the client sees one uninterrupted stream.

A break is D's connection failing, D's in-band error event, or its answer ending before
`[DONE]`. The policy, per break (at most `max_migrations` new pairs per stream):

- The request cannot be continued token-exactly (`resume_request.unsupported`: n > 1, tools,
  structured output, stop strings, ...): the client gets an SSE error event and [DONE].
- D had finished (its last chunk passed) but the stream had not: the router ends it.
- Nothing reached the client yet: the original request goes to a fresh pair.
- D's token 1 was not P's, which the client already has (push, first_token.py): the
  stream moves on as below, the same D allowed (it is not broken).
- Else a pull prefill of prompt + the tokens sent (`resume_request.continuation_body`) on the
  least-loaded P (retried on another P, `prefill.py`), then that P's KV to the least-loaded D not
  yet failed in this stream. A D that refuses is skipped; no D or P left: an SSE error
  event saying so, then [DONE].

Greedy requests continue with exactly the tokens an uninterrupted run would have sent
(up to the same floating-point near-ties any P/D handoff has). With sampling
(temperature > 0) the continuation is a fresh sample conditioned on the tokens already
sent: distributed as the rest of an uninterrupted run would be, but not the same draw, a
`seed` included (its generator restarts at the break). Penalties counting output tokens
(presence, frequency) no longer see the tokens before the break as output.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

import httpx

from ..errors import RouterError, from_transport
from ..fleet.upstreams import Upstream
from ..wire import bodies
from ..wire.resume import EventRewriter
from ..wire.resume_request import Progress, closing_events, continuation_body, unsupported
from ..wire.sse import Leg
from ..wire.sse_filters import EngineFieldFilter
from ..wire.stream_client import LegResponse, open_leg
from .context import FlowContext, json_headers, passive, wire_failed
from .offer_release import release_soon
from .prefill import build_legs, prefill_with_retry
from .request import RouterRequest

log = logging.getLogger(__name__)


class Migration:
    """One client stream's continuation policy (see the module docstring)."""

    def __init__(self, ctx: FlowContext, req: RouterRequest) -> None:
        self.ctx = ctx
        self.endpoint = req.endpoint
        self.path = req.path
        self.clean = req.body
        self.headers = req.headers
        self.turn = req.turn
        self.why_not = (unsupported(req.endpoint, req.body) if ctx.settings.max_migrations
                        else "migration off")
        self.progress = Progress(req.endpoint, want_ids=bool(req.body.get("return_token_ids")))
        self.left = ctx.settings.max_migrations
        self.failed: set[str] = set()
        self.rewriter: EventRewriter | None = None  # the current leg's
        # The leg's observers (`observer.Observers`), told of every leg the stream moves to.
        self.on_stream_params: Callable[[dict[str, Any]], None] | None = None
        self.on_stream_done: Callable[[], None] | None = None
        self.on_moved: Callable[[Upstream], None] | None = None

    def decode_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """D's leg: asked for token ids when the stream can be continued."""
        return body if self.why_not else {**body, "return_token_ids": True}

    def leg(self, resp: LegResponse, d: Upstream, offset: int | None = None) -> Leg:
        """A D answer as a leg of the client's stream: D's events recorded and rewritten
        (when continuable), then engine-owned fields removed."""
        self.failed.add(d.url)
        scrub = EngineFieldFilter(self.on_stream_params, self.on_stream_done)
        if self.why_not:
            return Leg(resp, d.url, scrub, on_close=lambda: self.ctx.decode.release(d))
        rewriter = self.rewriter = EventRewriter(self.progress, offset, then=scrub)
        return Leg(resp, d.url, rewriter,
                   on_close=lambda: self.ctx.decode.release(d), broken=rewriter.broken,
                   cut=lambda: rewriter.mismatch)

    def splice(self, token_id: int, text: str) -> None:
        """P's token 1 went to the client through the current leg (first_token.py)."""
        assert self.rewriter is not None
        self.rewriter.splice(token_id, text, lambda ok: self.ctx.metrics.first_token.labels(
            result="spliced" if ok else "mismatch").inc())

    async def resume(self, url: str, err: RouterError) -> Leg | bytes | RouterError:
        """The next leg after the leg on `url` broke with `err` (see module docstring)."""
        ctx, p = self.ctx, self.progress
        if self.rewriter is not None and self.rewriter.mismatch:
            self.failed.discard(url)  # D is fine: its token 1 only lost a near-tie to P's
        elif (up := ctx.decode.get(url)) is not None:
            passive(ctx.decode, up, False)
        if self.why_not:
            self.ctx.metrics.migrations.labels(result="unsupported").inc()
            return RouterError(err.status, f"{err.message}; the stream cannot continue on "
                               f"another engine ({self.why_not})", err.err_type, err.leg,
                               err.kind)
        if p.finished:
            ctx.metrics.migrations.labels(result="finished").inc()
            return closing_events(p, self.clean, None)
        if p.events == 0:  # nothing reached the client: the request itself, afresh
            path, body, offset = self.path, {**self.clean, "return_token_ids": True}, None
        else:
            if p.prompt_ids is None and self.endpoint == bodies.COMPLETIONS and isinstance(
                    self.clean.get("prompt"), list):
                p.prompt_ids = list(self.clean["prompt"])
            if p.prompt_ids is None:
                return self._give_up("unsupported", err, "decode reported no prompt token ids")
            cont = continuation_body(p, self.clean)
            if cont is None:  # every token was sent; only the last chunk was missing
                ctx.metrics.migrations.labels(result="finished").inc()
                return closing_events(p, self.clean, "length")
            path, body, offset = "/v1/completions", cont, len(p.sent)
        while self.left > 0:
            self.left -= 1
            try:
                d = ctx.decode.choose(exclude=self.failed)
            except RouterError:
                break
            got = await self._pair(d, path, body)
            if isinstance(got, RouterError):
                return self._give_up("no_engine", err, got.message)
            if got is None:  # that D refused: the next one
                self.failed.add(d.url)
                continue
            ctx.metrics.migrations.labels(result="ok").inc()
            ctx.metrics.migrated_tokens.inc(len(p.sent))
            log.warning("%s; continuing the stream on %s after %d tokens", err.message, d.url,
                        len(p.sent))
            if self.on_moved is not None:
                self.on_moved(d)
            return self.leg(got, d, offset)
        return self._give_up("no_engine", err, "no decode engine left")

    async def _pair(self, d: Upstream, path: str, body: dict[str, Any]
                    ) -> LegResponse | RouterError | None:
        """Prefill `body` on a P, then open D's stream from that P's KV: D's answer, None
        when D refused, or why no P served the prefill."""
        ctx = self.ctx
        transfer = uuid.uuid4().hex
        headers = {**self.headers, "x-request-id": transfer}
        legs = build_legs("pull", bodies.COMPLETIONS if path == "/v1/completions"
                          else self.endpoint, body, transfer)
        try:
            _, p_resp, _ = await prefill_with_retry(ctx, path, legs.prefill_body, headers)
        except RouterError as e:
            return e
        if p_resp.status_code != 200:
            return RouterError(502, f"prefill answered HTTP {p_resp.status_code}: "
                               f"{p_resp.text[:300]}", "upstream_error", "prefill", "migrate")
        try:
            kv = bodies.extract_kv_params(p_resp.json()) or {}
        except ValueError:  # malformed JSON, bad UTF-8 (both ValueErrors)
            kv = {}
        offer = kv
        if self.turn is not None:  # a fresh lease: whatever the broken D granted is stale
            self.turn.lease_id = uuid.uuid4().hex
            kv = {**kv, **self.turn.lease_request(ctx.settings.lease_ttl_s)}
        ctx.decode.acquire(d)
        try:
            resp = await open_leg(ctx.streams, ctx.client, d.url + path,
                                  bodies.encode(bodies.decode_body(body, kv or None)),
                                  json_headers(headers), ctx.timeout("decode"))
        except httpx.HTTPError as exc:
            ctx.decode.release(d)
            ctx.metrics.upstream_answers.labels(leg="decode", code="error").inc()
            release_soon(ctx, offer)  # no D will read P's offer
            wire_failed(ctx.decode, d, from_transport(exc, "decode", d.url))
            log.warning("migration: decode %s unreachable (%s)", d.url, type(exc).__name__)
            return None
        except BaseException:
            ctx.decode.release(d)
            release_soon(ctx, offer)
            raise
        ctx.metrics.upstream_answers.labels(leg="decode", code=str(resp.status_code)).inc()
        passive(ctx.decode, d, resp.status_code < 500)
        if resp.status_code != 200:
            await resp.aclose()
            ctx.decode.release(d)
            release_soon(ctx, offer)
            log.warning("migration: decode %s answered HTTP %d", d.url, resp.status_code)
            return None
        return resp

    def _give_up(self, result: str, err: RouterError, why: str) -> RouterError:
        self.ctx.metrics.migrations.labels(result=result).inc()
        return RouterError(err.status, f"{err.message}; the stream could not continue after "
                           f"{len(self.progress.sent)} tokens: {why}", err.err_type, err.leg,
                           err.kind)
