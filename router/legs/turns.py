"""A conversation turn inside one request: what P reported reusing of D's KV, and what
D's answer commits to the conversation state (`conversations.front`), told as an observer
of the decode leg."""

from __future__ import annotations

from typing import Any

from kvferry.connectors.protocol import params as kv

from ..conversations import continuation
from ..conversations.answer_capture import AnswerCapture, answer_of_json
from ..conversations.front import Conversations
from ..conversations.history import Answer
from ..conversations.turn import Turn
from ..fleet.upstreams import Upstream
from .context import FlowContext
from .observer import DecodeObserver

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


def turn_observers(ctx: FlowContext, turn: Turn | None, d: Upstream) -> list[DecodeObserver]:
    """Who follows a decode leg for its conversation turn: its commit (none without one)."""
    conv = ctx.conversations
    return [] if turn is None or conv is None else [TurnCommit(conv, turn, d.url)]


class TurnCommit(DecodeObserver):
    """Records the turn's lease once D answered well (JSON: from its body; SSE: at D's
    `[DONE]`, else at a clean end), on the D that finished the stream (another one when it
    migrated). For a chat or text prompt it first records the history D then holds, from
    the answer the client got (`continuation.record`; a content turn gets its key): an
    answer that cannot be recorded releases the lease instead."""

    def __init__(self, conv: Conversations, turn: Turn, decode_url: str) -> None:
        self.conv, self.turn, self.at = conv, turn, decode_url
        self._streamed: dict[str, Any] = {}
        self._committed = False
        view = turn.view
        self.chat = view is not None and view.kind == "chat"
        # token ids: D's block hashes say what it holds, exactly; nothing to capture
        self.capture = (AnswerCapture(self.chat, self._captured)
                        if view is not None and view.kind in ("chat", "text") else None)
        self.chunk_filter = self.capture

    def _recorded(self, answer: Answer | None) -> bool:
        if self.capture is None or continuation.record(self.turn, answer):
            return True
        self.conv.metrics.content_matches.labels(result="unrecorded").inc()
        return False

    async def answered(self, data: bytes, params: dict[str, Any] | None) -> None:
        answer = answer_of_json(data, self.chat) if self.capture is not None else None
        if not self._recorded(answer):
            await self.conv.release_lease(self.turn.lease_id, self.at)
            return
        if not self.conv.commit_offer(self.turn, self.at, kv.answered_lease(params)):
            self.conv.commit_later(self.turn, self.at)  # e.g. an engine that keeps params to itself
        await self.conv.settled(self.turn)  # recorded (shared state too) before the client has it

    def stream_params(self, params: dict[str, Any]) -> None:
        self._streamed.update(params)

    async def recorded(self) -> None:
        # The commit started at D's [DONE] (`_commit_stream`, or the capture once it saw
        # the whole answer); with shared state (Redis, the workers' SQLite file) another
        # router process takes the next turn, so the client gets [DONE] once it is stored.
        await self.conv.settled(self.turn)

    def stream_done(self) -> None:
        if self.capture is None:  # else the capture commits, once it saw the whole answer
            self._commit_stream()

    def ended(self, clean: bool) -> None:
        if clean:
            if self.capture is not None:
                self.capture.finish()
            else:
                self._commit_stream()

    def moved(self, d: Upstream) -> None:
        self.at = d.url
        self._streamed.clear()

    def _captured(self, answer: Answer | None) -> None:
        if self._recorded(answer):
            self._commit_stream()
        else:
            self.conv.spawn(self.conv.release_lease(self.turn.lease_id, self.at))

    def _commit_stream(self) -> None:
        # Once, at D's `[DONE]` (before the client has it, so that its next turn, sent the
        # moment the stream ends, finds the commit under way), else at a clean end. vLLM
        # 0.33 streams D's params on the last chunk; older versions do not, so the offer is
        # then fetched over the lease-control channel (D granted it when the request ended).
        if self._committed:
            return
        self._committed = True
        if not (self._streamed and self.conv.commit_offer(
                self.turn, self.at, kv.answered_lease(self._streamed))):
            self.conv.commit_later(self.turn, self.at)
