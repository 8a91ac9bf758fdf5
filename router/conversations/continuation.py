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

A content-keyed turn gets its key when D's answer is complete (`record`, called by the
turn's commit in `legs.turns`), just before the commit; an answer the router cannot follow
(several choices, an error event) is not recorded, and its lease is released at once.

Pure of the registry's front (`front.Conversations` calls these, never the reverse): the
state and the wait for a commit in flight are passed in.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable

from . import history
from .history import Answer
from .registry import ConversationEntry, ConversationRegistry
from .state import ConversationState
from .turn import Turn


async def begin(state: ConversationState, settle: Callable[[str, str], Awaitable[None]],
                tenant: str, view: history.PromptView) -> Turn | None:
    """A content-keyed turn for a request without an id (None: not a chat it can follow);
    its `entry` is the turn it continues, if any. `settle(tenant, key)` waits for that
    turn's commit, which may still be under way."""
    if view.kind != "chat" or view.choices != 1:
        return None
    entry, key = None, None
    for cand in history.candidate_keys(view):
        await settle(tenant, cand)
        found = await state.get(tenant, cand, time.time())
        if found is not None and history.delta(found.history, view) is not None:
            entry, key = found, cand
            break
    return Turn(tenant, "", uuid.uuid4().hex, entry, view=view, continues=key, content=True)


def record(turn: Turn, answer: Answer | None) -> bool:
    """Record on the turn the history D holds once it gave `answer` (and key a content
    turn by it); False when a content turn cannot be recorded (nobody can continue it)."""
    assert turn.view is not None
    turn.history = history.record(turn.view, answer) if answer is not None else None
    if not turn.content:
        return True
    if turn.history is None:
        return False
    turn.conversation_id = history.content_key(turn.history)
    return True


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
