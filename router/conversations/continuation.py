"""Conversations without ids, recognised from their content; and, for every turn, the
record of what D holds once it answered (`history.record`).

Strict OpenAI clients and chat frontends send no conversation id: they resend the whole
history. Within a tenant, a chat request continues an earlier turn iff its messages start
with exactly that turn's messages plus the answer the router passed back: the registry key
of such a turn is the digest of that history (`history.content_key`), and a request looks
up the digests of its prefixes ending with an assistant message (`history.candidate_keys`,
longest first). An entry is used only if its own record agrees (`history.delta`).

- An explicit id wins: content is consulted only for requests that carry none.
- Edits: an edited message changes every later digest, so no entry matches.
- Forks: two continuations of one entry both match it; each commits its own key, and only
  the first retires (releases) the entry they continued, so both branches keep theirs. A
  later fork of a turn already continued finds no entry: it recomputes (never wrong).
- Tenants: keys live under the tenant (a hash of the API key), as every entry does.
- Bounds: content entries are registry entries: the lease TTL and the LRU cap apply.

A content-keyed turn gets its key when D's answer is complete (`track`), just before the
commit; an answer the router cannot follow (several choices, an error event) is not
recorded, and its lease is released at once.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from ..wire.sse import ChainedFilter
from . import history, lease_control
from .answer_capture import AnswerCapture, answer_of_json
from .history import Answer
from .registry import ConversationEntry, ConversationRegistry
from .state import ConversationState

if TYPE_CHECKING:
    from ..fleet.upstreams import Upstream
    from ..legs.decode import DecodeHooks
    from .front import Conversations, Turn

log = logging.getLogger(__name__)


async def begin(conv: Conversations, tenant: str, view: history.PromptView) -> Turn | None:
    """A content-keyed turn for a request without an id (None: not a chat it can follow)."""
    from .turn import Turn

    if view.kind != "chat" or view.choices != 1:
        return None
    entry, key = None, None
    for cand in history.candidate_keys(view):
        await conv.settle_key(tenant, cand)  # that turn's commit may still be under way
        found = await conv.state.get(tenant, cand, time.time())
        if found is not None and history.delta(found.history, view) is not None:
            entry, key = found, cand
            break
    conv.metrics.content_matches.labels(result="hit" if entry else "miss").inc()
    return Turn(tenant, "", uuid.uuid4().hex, entry, view=view, continues=key, content=True)


def retire_memory(registry: ConversationRegistry, turn: Turn) -> list[ConversationEntry]:
    """After a content-keyed commit: forget the entry the turn continued, if it still is
    the one it read (a fork that committed first has already retired it)."""
    if not (turn.continues and turn.entry) or turn.continues == turn.conversation_id:
        return []
    old = registry.get(turn.tenant, turn.continues, time.time())
    if old is None or old.lease_id != turn.entry.lease_id:
        return []
    registry.drop(turn.tenant, turn.continues)
    return [old]


async def retire(state: ConversationState, turn: Turn) -> list[ConversationEntry]:
    """`retire_memory` for shared state (get, compare, drop: a race with another replica
    retiring it too drops it once; one recompute at worst, never a wrong answer)."""
    if not (turn.continues and turn.entry) or turn.continues == turn.conversation_id:
        return []
    old = await state.get(turn.tenant, turn.continues, time.time())
    if old is None or old.lease_id != turn.entry.lease_id:
        return []
    dropped = await state.drop(turn.tenant, turn.continues)
    return [dropped] if dropped is not None and dropped.lease_id == old.lease_id else []


def track(conv: Conversations, turn: Turn, decode_url: str, hooks: DecodeHooks) -> DecodeHooks:
    """Wrap a turn's commit hooks (`turns.commit_hooks`): capture D's answer, record the
    history D holds on the turn (and key a content turn) before the commit runs. An
    answer that cannot be recorded releases the lease on the D that finished the turn:
    `decode_url` until the stream moves (`hooks.on_moved`, a migration) to another D."""
    view = turn.view
    if view is None or view.kind not in ("chat", "text"):
        return hooks  # token ids: D's block hashes say what it holds, exactly
    chat = view.kind == "chat"
    commit_json, commit_stream = hooks.on_d_params, hooks.on_stream_done
    answers: list[Answer | None] = []
    at = [decode_url]
    moved = hooks.on_moved

    def on_moved(up: Upstream) -> None:
        at[0] = up.url
        if moved is not None:
            moved(up)

    def keyed(answer: Answer | None) -> bool:
        turn.history = history.record(view, answer) if answer is not None else None
        if not turn.content:
            return True
        if turn.history is None:
            conv.metrics.content_matches.labels(result="unrecorded").inc()
            return False
        turn.conversation_id = history.content_key(turn.history)
        return True

    def on_answer(data: bytes) -> None:
        answers.append(answer_of_json(data, chat))

    async def on_json(params: dict[str, Any] | None) -> None:
        if keyed(answers[0] if answers else None):
            if commit_json is not None:
                await commit_json(params)
        else:
            await discard(conv, turn, at[0])

    def on_done(answer: Answer | None) -> None:
        if keyed(answer):
            if commit_stream is not None:
                commit_stream()
        else:
            conv.spawn(discard(conv, turn, at[0]))

    capture = AnswerCapture(chat, on_done)
    hooks.on_moved = on_moved
    hooks.on_answer = on_answer
    hooks.on_d_params = on_json
    hooks.on_stream_done = None  # the capture calls it, once it has seen the whole answer
    hooks.on_success = capture.finish
    hooks.chunk_filter = (capture if hooks.chunk_filter is None
                          else ChainedFilter(capture, hooks.chunk_filter))
    return hooks


async def discard(conv: Conversations, turn: Turn, decode_url: str) -> None:
    """Release the lease D granted for a turn nobody can continue."""
    addr = conv.settings.decode_control_addr(decode_url)
    if addr is None:
        return
    reply = await lease_control.call(*addr, "release", turn.lease_id,
                                     timeout_s=conv.settings.connect_timeout_s, key=conv.secret)
    if not reply.get("ok") and reply.get("error") not in ("expired", "released", "unknown"):
        log.warning("could not release lease %s on %s: %s", turn.lease_id, decode_url,
                    reply.get("error"))
