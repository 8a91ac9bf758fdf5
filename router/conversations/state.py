"""Where the router keeps conversation entries: this process's memory, or Redis (or the
SQLite file its worker processes share, sqlite_state.py).

One interface, three implementations. `MemoryState` is the LRU `ConversationRegistry` of one
router process. `RedisState` lets every router replica serve any turn with reuse: an
entry is written only after a successful turn, under a key per (tenant, conversation id),
with a Redis TTL at D's lease expiry, and replaced atomically (``SET ... GET``) so the
replacer alone gets the old entry back and releases its lease. Its memory is bounded by
the keys' TTLs and the operator's ``maxmemory`` policy.

Redis is an optimisation, never a dependency of a request: every call is bounded by
`timeout_s` and a failure means "no entry" (the turn recomputes). After a failure Redis is
left alone for `backoff_s` so a dead Redis costs requests nothing; it is then tried again
and sharing resumes by itself (connections kept from before a restart are replaced on the
first call that meets one). Failures are counted (``kvferry_router_state_errors``) and
logged at most every `store_log.LOG_EVERY_S`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from ..metrics import RouterMetrics
from .entry_codec import decode_entry, encode_entry
from .registry import ConversationEntry, ConversationRegistry
from .sqlite_state import URL_PREFIX, SqliteState, path_of
from .store_log import ThrottledLog

log = logging.getLogger(__name__)

KEY_PREFIX = "kvferry:conv:"


class ConversationState(Protocol):
    """The conversation store the router talks to (see module docstring)."""

    async def get(self, tenant: str, conversation_id: str, now: float) -> ConversationEntry | None:
        """The live entry, or None (also when the store cannot answer)."""
        ...

    async def replace(self, tenant: str, conversation_id: str, entry: ConversationEntry
                      ) -> list[ConversationEntry] | None:
        """Store a successful turn's entry. Returns the entries let go whose leases the
        caller must release, or None when the store could not record it."""
        ...

    async def drop(self, tenant: str, conversation_id: str) -> ConversationEntry | None:
        """Forget the conversation; returns its entry (to release its lease)."""
        ...

    async def size(self) -> int | None:
        """Entries held (None: unknown right now)."""
        ...

    async def close(self) -> None: ...


class MemoryState:
    """This process's `ConversationRegistry` (the router's behaviour without Redis)."""

    def __init__(self, registry: ConversationRegistry) -> None:
        self.registry = registry

    async def get(self, tenant: str, conversation_id: str, now: float) -> ConversationEntry | None:
        return self.registry.get(tenant, conversation_id, now)

    async def replace(self, tenant: str, conversation_id: str, entry: ConversationEntry
                      ) -> list[ConversationEntry]:
        return self.registry.update(tenant, conversation_id, entry)

    async def drop(self, tenant: str, conversation_id: str) -> ConversationEntry | None:
        return self.registry.drop(tenant, conversation_id)

    async def size(self) -> int:
        return self.registry.size

    async def close(self) -> None:
        return None


class RedisState:
    """Entries in Redis, shared by every router replica pointing at the same database."""

    def __init__(self, url: str, metrics: RouterMetrics, timeout_s: float = 0.1,
                 backoff_s: float = 1.0, max_connections: int = 64, client: Any = None
                 ) -> None:
        from redis.asyncio import BlockingConnectionPool, Redis
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.retry import Retry

        self.url = url
        self.max_connections = max_connections
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        # No client-side retries: a failed call is answered "no entry" at once, and the
        # next request (after the backoff) tries again. A bounded pool: under a burst,
        # calls wait (at most timeout_s) for a connection instead of opening thousands.
        pool = BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout_s,
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self.redis = client or Redis(connection_pool=pool)
        self._connection_error = RedisConnectionError
        self._down_until = 0.0
        self._log = ThrottledLog(log)
        self.available = True

    @staticmethod
    def key(tenant: str, conversation_id: str) -> str:
        return f"{KEY_PREFIX}{tenant}:{conversation_id}"

    async def _call(self, op: str, fn: Any) -> tuple[bool, Any]:
        """(ok, result) of one bounded Redis call; failures counted, logged, backed off."""
        now = time.monotonic()
        if now < self._down_until:
            self.metrics.state_errors.labels(op=op, kind="skipped").inc()
            return False, None
        try:
            async with asyncio.timeout(self.timeout_s * 2):
                try:
                    result = await fn()
                except self._connection_error:
                    # Idle connections from before a Redis restart fail once each ("closed
                    # by server"): drop them all and try once on a fresh one (a dead Redis
                    # refuses it at once), so state is back on the first call.
                    await self.redis.connection_pool.disconnect(inuse_connections=False)
                    result = await fn()
        except Exception as exc:  # noqa: BLE001 - any failure means "no shared state"
            self._down_until = time.monotonic() + self.backoff_s
            self._set_available(False)
            kind = "timeout" if isinstance(exc, TimeoutError) else type(exc).__name__
            self.metrics.state_errors.labels(op=op, kind=kind).inc()
            self._log.warning(f"redis {op} failed ({kind}: {exc}); serving without shared "
                      "conversation state")
            return False, None
        self._set_available(True)
        return True, result

    def _set_available(self, up: bool) -> None:
        if up != self.available:
            self.available = up
            self.metrics.state_up.set(1 if up else 0)
            if up:
                log.info("redis %s is back: sharing conversation state again", self.url)

    async def get(self, tenant: str, conversation_id: str, now: float) -> ConversationEntry | None:
        _, raw = await self._call("get", lambda: self.redis.get(self.key(tenant, conversation_id)))
        entry = decode_entry(raw)
        return entry if entry is not None and now < entry.expiry else None

    async def replace(self, tenant: str, conversation_id: str, entry: ConversationEntry
                      ) -> list[ConversationEntry] | None:
        key = self.key(tenant, conversation_id)
        pxat = int(entry.expiry * 1000)
        if pxat <= int(time.time() * 1000):
            old = await self.drop(tenant, conversation_id)
            return [e for e in (old, entry) if e is not None]
        # SET .. GET is atomic: of two replicas replacing one entry, each gets back what
        # it replaced, so every displaced lease is released exactly once.
        ok, raw = await self._call("replace", lambda: self.redis.set(
            key, encode_entry(entry), pxat=pxat, get=True))
        if not ok:
            return None
        old = decode_entry(raw)
        return [old] if old is not None and old.lease_id != entry.lease_id else []

    async def drop(self, tenant: str, conversation_id: str) -> ConversationEntry | None:
        _, raw = await self._call("drop", lambda: self.redis.getdel(
            self.key(tenant, conversation_id)))
        return decode_entry(raw)

    async def size(self) -> int | None:
        """Keys in the database (give kvferry a database of its own for this to be exact)."""
        ok, n = await self._call("size", self.redis.dbsize)
        return int(n) if ok else None

    async def close(self) -> None:
        await self.redis.aclose()
        await self.redis.connection_pool.disconnect()


def open_state(url: str, registry: ConversationRegistry, metrics: RouterMetrics,
               timeout_s: float = 0.1, backoff_s: float = 1.0) -> ConversationState:
    """`memory` -> MemoryState over `registry`; `sqlite:///path` -> SqliteState (the
    worker processes of one host); `redis://` / `rediss://` / `unix://` -> RedisState."""
    if url == "memory":
        return MemoryState(registry)
    if url.startswith(URL_PREFIX):
        return SqliteState(path_of(url), metrics, timeout_s=timeout_s,
                           max_entries=registry.max_entries)
    return RedisState(url, metrics, timeout_s=timeout_s, backoff_s=backoff_s)
