"""A conversation turn inside one request: what P reported reusing of D's KV, and what
D's answer commits to the conversation state (see `conversations.py`)."""

from __future__ import annotations

from typing import Any

from kvferry.connectors.protocol import params as kv

from ..conversations import continuation
from ..conversations.front import Turn
from ..fleet.upstreams import Upstream
from .context import FlowContext
from .decode import DecodeHooks

REUSE_REPORT = kv.REUSE_REPORT_KEYS


def reuse_report(ctx: FlowContext, turn: Turn | None, kv_params: dict[str, Any]
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


def commit_hooks(ctx: FlowContext, turn: Turn | None, d: Upstream, hooks: DecodeHooks
                 ) -> DecodeHooks:
    """Record the turn's lease once D answered well (JSON: from its body; SSE: afterwards),
    on the D that finished the stream (another one when it migrated)."""
    conv = ctx.conversations
    if turn is None or conv is None:
        return hooks
    at = [d.url]

    async def on_json(params: dict[str, Any] | None) -> None:
        if not conv.commit_offer(turn, at[0], kv.answered_lease(params)):
            conv.commit_later(turn, at[0])  # e.g. an engine that keeps params to itself
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
        if not (streamed and conv.commit_offer(turn, at[0], kv.answered_lease(streamed))):
            conv.commit_later(turn, at[0])

    def on_moved(up: Upstream) -> None:
        at[0] = up.url
        streamed.clear()

    hooks.on_d_params = on_json
    hooks.on_stream_params = on_stream_params
    hooks.on_stream_done = on_stream_end
    hooks.on_success = on_stream_end
    hooks.on_moved = on_moved
    return continuation.track(conv, turn, d.url, hooks)  # records what D holds first
