"""Conversations: where each conversation's last turn left its KV, and its D-side lease.

One turn, seen from the router (see `flow.py` for the legs):

1. `begin` finds the conversation id (body or agent session headers) and the tenant (a
   hash of the API key). If the registry holds a live entry, P is sent D's signed lease
   offer (``kv_transfer_params.reuse``) and the conversation prefers that entry's D.
2. D is asked to keep this turn's blocks under a new lease (``kv_transfer_params.lease``).
3. After the D leg succeeded, `commit` records D's offer (from the JSON answer, or for a
   stream from D's lease-control channel) and releases the lease it replaces. A failed
   turn commits nothing: the previous entry stays usable.

Leases are renewed by `heartbeat` and ended by `end` (or by TTL on D). Entries are scoped
per tenant, so one API key can never make P read another's blocks.

Entries live in a `state.ConversationState`: this process's registry (``memory``, the
default) or Redis shared by every replica. With Redis a commit is a write the next turn on
this replica waits for (`_pending`); a write that fails releases the turn's new lease
at once, since no replica will ever offer it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..metrics import RouterMetrics
from ..settings import RouterSettings
from . import continuation, history, lease_control
from .caller import caller_key
from .registry import (
    ConversationEntry,
    ConversationRegistry,
    conversation_id_from,
    tenant_of,
)
from .state import ConversationState, MemoryState, open_state
from .turn import Turn

log = logging.getLogger(__name__)

GONE = ("expired", "released", "unknown")  # lease errors meaning: the blocks are gone


class LeaseUnavailable(RuntimeError):
    """D did not answer the lease channel properly (unreachable, refused, internal)."""




class Conversations:
    """The router's side of conversations: finds the turn a request continues (by id or by
    content), asks D for leases and commits what D holds once the turn answered."""

    def __init__(self, settings: RouterSettings, metrics: RouterMetrics,
                 secret: bytes = b"") -> None:
        self.settings = settings
        self.metrics = metrics
        self.registry = ConversationRegistry(settings.max_conversations)
        """This process's entries (``--state memory``; unused with Redis)."""
        self.state: ConversationState = open_state(settings.state, self.registry, metrics,
                                                   settings.state_timeout_s,
                                                   settings.state_retry_s)
        self._memory = isinstance(self.state, MemoryState)
        self._secret = secret
        self._pending: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def shared(self) -> bool:
        """Entries live outside this process (Redis, the workers' SQLite file): another
        router process may take a conversation's next turn."""
        return not self._memory

    @property
    def pending_commits(self) -> int:
        """Streamed turns whose offer this replica is still fetching from D (commit_later):
        0 once every one has been recorded or dropped."""
        return len(self._pending)

    # -- a turn ------------------------------------------------------------------------
    async def begin(self, body: Mapping[str, Any], headers: Any) -> Turn | None:
        cid = conversation_id_from(body, headers)
        if cid is None and not self.settings.content_reuse:
            return None
        view = history.view_of(body)
        tenant = tenant_of(caller_key(headers), self._secret)
        if cid is None:  # an explicit id wins; without one, the content may say
            turn = await continuation.begin(self.state, self._settle, tenant, view)
            if turn is not None:
                self.metrics.content_matches.labels(
                    result="hit" if turn.entry else "miss").inc()
            return turn
        await self._settle(tenant, cid)  # the previous streamed turn is still being recorded
        entry = await self.state.get(tenant, cid, time.time())
        self._gauge()
        return Turn(tenant, cid, uuid.uuid4().hex, entry, view=view)

    def _entry_of(self, turn: Turn, decode_url: str, offer: Any) -> ConversationEntry | None:
        if not isinstance(offer, Mapping):
            return None
        try:
            entry = ConversationEntry(
                decode_url=decode_url, engine_id=str(offer["engine_id"]),
                lease_id=str(offer["lease_id"]), expiry=float(offer["expiry"]),
                num_tokens=int(offer["num_tokens"]), kv_transfer_params=dict(offer),
                history=dict(turn.history or {}))
        except (KeyError, TypeError, ValueError):
            log.warning("conversation %s: malformed lease offer from %s",
                        history.printable(turn.conversation_id),
                        decode_url)
            return None
        return entry if entry.lease_id == turn.lease_id else None

    def commit_offer(self, turn: Turn, decode_url: str, offer: Any) -> bool:
        """Record a successful turn's lease offer (D's signed dict); False if unusable.
        In memory it is recorded now; with Redis the write is pending (see `settled`)."""
        entry = self._entry_of(turn, decode_url, offer)
        if entry is None:
            return False
        if self._memory:
            self._released(self._update_memory(turn, entry))
        else:
            self._track(turn, self._store(turn, entry))
        return True

    def commit_later(self, turn: Turn, decode_url: str) -> None:
        """Streamed turn: fetch D's offer over the control channel, before the next turn."""
        self._track(turn, self._fetch_and_commit(turn, decode_url))

    async def settled(self, turn: Turn) -> None:
        """Wait (bounded) until the turn's commit is recorded, so that the next turn, on
        any replica, finds it. Memory: nothing to wait for here (`begin` waits instead,
        and only this process can see the entry anyway)."""
        if self._memory:
            return
        pending = self._pending.get(turn.key)
        if pending is not None:
            await asyncio.wait({pending}, timeout=self.settings.connect_timeout_s)

    def _track(self, turn: Turn, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._pending[turn.key] = task
        self._tasks.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            if self._pending.get(turn.key) is t:
                del self._pending[turn.key]

        task.add_done_callback(done)

    async def _store(self, turn: Turn, entry: ConversationEntry) -> None:
        released = await self.state.replace(turn.tenant, turn.conversation_id, entry)
        if released is None:  # not recorded: nobody will offer this lease, free it now
            released = [entry]
        else:
            released += await continuation.retire(self.state, turn)
        self._released(released)

    def _update_memory(self, turn: Turn, entry: ConversationEntry) -> list[ConversationEntry]:
        return (self.registry.update(turn.tenant, turn.conversation_id, entry)
                + continuation.retire_memory(self.registry, turn))

    def _released(self, entries: list[ConversationEntry]) -> None:
        for old in entries:
            self._spawn(self._release(old))
        self._gauge()

    async def _fetch_and_commit(self, turn: Turn, decode_url: str) -> None:
        addr = self.settings.decode_control_addr(decode_url)
        if addr is None:
            return
        reply = await lease_control.call(addr, "info", turn.lease_id,
                                         timeout_s=self.settings.connect_timeout_s, key=self._secret)
        if reply.get("ok"):
            entry = self._entry_of(turn, decode_url, reply.get("offer"))
            if entry is not None and self._memory:
                self._released(self._update_memory(turn, entry))
            elif entry is not None:
                await self._store(turn, entry)
        else:
            log.info("conversation %s: no lease from %s (%s)",
                     history.printable(turn.conversation_id), decode_url,
                     reply.get("error"))

    # -- endpoints ---------------------------------------------------------------------
    def lookup(self, conversation_id: str, headers: Any) -> tuple[str, ConversationEntry | None]:
        """This process's entry (memory state only; `find` asks whichever state is used)."""
        tenant = tenant_of(caller_key(headers), self._secret)
        return tenant, self.registry.get(tenant, conversation_id, time.time())

    async def find(self, conversation_id: str, headers: Any
                   ) -> tuple[str, ConversationEntry | None]:
        tenant = tenant_of(caller_key(headers), self._secret)
        return tenant, await self.state.get(tenant, conversation_id, time.time())

    async def heartbeat(self, conversation_id: str, headers: Any, ttl: float | None = None
                        ) -> ConversationEntry | None:
        """Renew the conversation's lease on its D; None if there is nothing to renew.
        `LeaseUnavailable` if D could not say (the entry stays: the lease may be alive)."""
        tenant, entry = await self.find(conversation_id, headers)
        if entry is None:
            return None
        addr = self.settings.decode_control_addr(entry.decode_url)
        if addr is None:
            return None
        reply = await lease_control.call(addr, "renew", entry.lease_id, ttl,
                                         timeout_s=self.settings.connect_timeout_s, key=self._secret)
        if not reply.get("ok"):
            if reply.get("error") in GONE:
                await self.state.drop(tenant, conversation_id)
                self._gauge()
                return None
            raise LeaseUnavailable(f"decode {entry.decode_url}: {reply.get('error')}")
        offer = reply["offer"]
        new = replace(entry, expiry=float(offer["expiry"]), kv_transfer_params=dict(offer))
        await self.state.replace(tenant, conversation_id, new)
        return new

    async def end(self, conversation_id: str, headers: Any) -> bool:
        """End of conversation: forget it and release its blocks on D at once."""
        tenant = tenant_of(caller_key(headers), self._secret)
        await self._settle(tenant, conversation_id)  # a last streamed turn still recording
        entry = await self.state.drop(tenant, conversation_id)
        self._gauge()
        if entry is None:
            return False
        await self._release(entry)
        return True

    # -- internals -----------------------------------------------------------------------
    def spawn(self, coro: Any) -> None:
        self._spawn(coro)

    async def _settle(self, tenant: str, conversation_id: str) -> None:
        """Wait (bounded) for the conversation's commit in flight, if any."""
        pending = self._pending.get((tenant, conversation_id))
        if pending is not None:
            await asyncio.wait({pending}, timeout=self.settings.connect_timeout_s)

    async def _release(self, entry: ConversationEntry) -> None:
        await self.release_lease(entry.lease_id, entry.decode_url)

    async def release_lease(self, lease_id: str, decode_url: str) -> None:
        """Tell D to release a lease now (a replaced entry's, or a turn nobody can
        continue: its answer could not be recorded)."""
        addr = self.settings.decode_control_addr(decode_url)
        if addr is None:
            return
        reply = await lease_control.call(addr, "release", lease_id,
                                         timeout_s=self.settings.connect_timeout_s, key=self._secret)
        if not reply.get("ok") and reply.get("error") not in GONE:
            log.warning("could not release lease %s on %s: %s", lease_id, decode_url,
                        reply.get("error"))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _gauge(self) -> None:
        if self._memory:  # Redis: `refresh_size`, periodically (DBSIZE is a round trip)
            self.metrics.conversations.set(self.registry.size)

    async def refresh_size(self) -> None:
        if (n := await self.state.size()) is not None:
            self.metrics.conversations.set(n)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.state.close()
