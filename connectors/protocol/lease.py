"""Leases on D: keep a finished turn's KV blocks for the next turn, and free them safely.

After a turn D keeps the request's blocks so P can READ them for turn N+1 instead of
recomputing the whole history. Holding blocks costs decode capacity, so the hold is a
lease: it expires ``ttl`` seconds after the last grant/renewal (``decoder_kv_blocks_ttl``,
480 s), a heartbeat can renew it up to ``max_lifetime``, and an explicit release ends it
as soon as the conversation does. READs are one-sided, so D never sees them: the keeper
(`scheduling/lease_keeper.py`) delays every free by a grace longer than P's READ timeout.

Pure state machine: no I/O, no clocks (``now`` is passed in). Every lease's blocks are
reported in exactly one `FreeBlocks`; the glue frees them by ``req_id``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

DEFAULT_TTL = 480.0  # decoder_kv_blocks_ttl: the one default (config and keeper use it)
DEFAULT_MAX_LIFETIME = 3600.0  # lease_max_lifetime_s: renewals never go past it
DEFAULT_FREE_GRACE = 3.0  # lease_free_grace_s: > P's reuse READ timeout


class Refusal(StrEnum):
    """Why a lease operation cannot be honoured (the lease control channel's error)."""

    UNKNOWN = "unknown"
    EXPIRED = "expired"
    RELEASED = "released"
    DUPLICATE = "duplicate"
    TOO_LARGE = "too_large"
    INVALID = "invalid"


class Freed(StrEnum):
    """Why a lease's blocks were freed."""

    RELEASED = "released"
    EXPIRED = "expired"
    EVICTED = "evicted"


class LeaseError(Exception):
    """An operation on a lease that cannot be honoured; ``reason`` is machine-readable."""

    def __init__(self, lease_id: str, reason: Refusal, detail: str = "") -> None:
        self.lease_id = lease_id
        self.reason = reason
        super().__init__(f"lease {lease_id!r}: {reason}" + (f" ({detail})" if detail else ""))


@dataclass(frozen=True)
class _Held:
    """Which lease, for which of D's requests, holds which blocks."""

    lease_id: str
    req_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class FreeBlocks(_Held):
    """D may free this lease's blocks now (once per lease)."""

    reason: Freed


@dataclass(frozen=True)
class Lease(_Held):
    """A read-only view of one lease."""

    num_tokens: int
    prefix_hashes: tuple[str, ...]
    granted_at: float
    expiry: float
    deadline: float  # granted_at + max_lifetime: renewals never go past it


class LeaseTable:
    """All leases of one D engine, bounded by ``max_blocks`` held blocks."""

    def __init__(
        self,
        ttl: float = DEFAULT_TTL,
        *,
        max_lifetime: float = DEFAULT_MAX_LIFETIME,
        max_blocks: int | None = None,
        tombstone_ttl: float = 3600.0,
        max_tombstones: int = 100_000,
    ) -> None:
        if ttl <= 0 or max_lifetime <= 0:
            raise ValueError("ttl and max_lifetime must be positive")
        self.ttl = ttl
        self.max_lifetime = max_lifetime
        self.max_blocks = max_blocks
        self._held: OrderedDict[str, Lease] = OrderedDict()  # LRU: least recent first
        self._num_blocks = 0
        self._ended: OrderedDict[str, tuple[Refusal, float]] = OrderedDict()
        self._tombstone_ttl = tombstone_ttl
        self._max_tombstones = max_tombstones
        self._now = float("-inf")

    # -- operations -----------------------------------------------------------------

    def grant(self, lease_id: str, req_id: str, block_ids: Sequence[int], num_tokens: int,
              prefix_hashes: Sequence[str], now: float, ttl: float | None = None
              ) -> tuple[float, list[FreeBlocks]]:
        """Lease ``block_ids`` after a turn. Returns (expiry, leases evicted to make room).

        ``ttl`` (at most the table's) shortens this lease's first term.

        Raises LeaseError without side effects if the lease cannot be held; the caller
        still owns and frees the blocks then.
        """
        self._now = max(self._now, now)
        blocks = tuple(block_ids)
        if lease_id in self._held or lease_id in self._ended:
            raise LeaseError(lease_id, Refusal.DUPLICATE, "lease ids must never be reused")
        if num_tokens < 0 or any(b < 0 for b in blocks):
            raise LeaseError(lease_id, Refusal.INVALID, "negative token count or block id")
        freed = self._sweep(now)
        if self.max_blocks is not None:
            if len(blocks) > self.max_blocks:
                raise LeaseError(lease_id, Refusal.TOO_LARGE,
                                 f"{len(blocks)} blocks > max_blocks {self.max_blocks}")
            freed += self._make_room(len(blocks))
        deadline = now + self.max_lifetime
        view = Lease(lease_id, req_id, blocks, num_tokens, tuple(prefix_hashes), now,
                     min(now + min(self.ttl, ttl or self.ttl), deadline), deadline)
        self._held[lease_id] = view
        self._num_blocks += len(blocks)
        return view.expiry, freed

    def renew(self, lease_id: str, now: float, ttl: float | None = None) -> float:
        """Heartbeat: extend to ``now + ttl`` (never shortens, never past the deadline)."""
        self._now = max(self._now, now)
        v = self._live(lease_id, now)
        expiry = max(v.expiry, min(now + (self.ttl if ttl is None else ttl), v.deadline))
        self._held[lease_id] = Lease(v.lease_id, v.req_id, v.block_ids, v.num_tokens,
                                     v.prefix_hashes, v.granted_at, expiry, v.deadline)
        self._held.move_to_end(lease_id)
        return expiry

    def release(self, lease_id: str, now: float | None = None) -> list[FreeBlocks]:
        """End the lease now (conversation over, router dropped it, memory is short)."""
        if now is not None:
            self._now = max(self._now, now)
        self._get(lease_id)
        return [self._free(lease_id, Freed.RELEASED)]

    def tick(self, now: float) -> list[FreeBlocks]:
        """Free expired leases; forget old tombstones."""
        self._now = max(self._now, now)
        return self._sweep(now)

    # -- inspection -----------------------------------------------------------------

    def get(self, lease_id: str) -> Lease | None:
        return self._held.get(lease_id)

    def least_recent(self) -> str | None:
        """The lease renewed or granted longest ago (the first to yield under pressure)."""
        return next(iter(self._held), None)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    @property
    def num_blocks(self) -> int:
        """Blocks held by leases (expired ones included until the next tick or grant)."""
        return self._num_blocks

    # -- internals ------------------------------------------------------------------

    def _get(self, lease_id: str) -> Lease:
        v = self._held.get(lease_id)
        if v is None:
            ended = self._ended.get(lease_id)
            if ended is not None:
                raise LeaseError(lease_id, ended[0], "lease already ended and freed")
            raise LeaseError(lease_id, Refusal.UNKNOWN)
        return v

    def _live(self, lease_id: str, now: float) -> Lease:
        v = self._get(lease_id)
        if now >= v.expiry:
            raise LeaseError(lease_id, Refusal.EXPIRED, f"expired at {v.expiry}")
        return v

    def _free(self, lease_id: str, reason: Freed) -> FreeBlocks:
        v = self._held.pop(lease_id)
        self._num_blocks -= len(v.block_ids)
        # Tombstone reason for later calls: expired leases say "expired", others "released".
        self._ended[lease_id] = (Refusal.EXPIRED if reason is Freed.EXPIRED else Refusal.RELEASED,
                                 self._now)
        while len(self._ended) > self._max_tombstones:
            self._ended.popitem(last=False)
        return FreeBlocks(lease_id, v.req_id, v.block_ids, reason)

    def _sweep(self, now: float) -> list[FreeBlocks]:
        out = [self._free(lid, Freed.EXPIRED)
               for lid, v in list(self._held.items()) if now >= v.expiry]
        for lid, (_, at) in list(self._ended.items()):
            if now - at < self._tombstone_ttl:
                break
            del self._ended[lid]
        return out

    def _make_room(self, need: int) -> list[FreeBlocks]:
        """Evict least recently used leases until ``need`` more blocks fit."""
        assert self.max_blocks is not None
        excess = self._num_blocks + need - self.max_blocks
        victims: list[str] = []
        for lid, v in self._held.items():  # least recently used first
            if excess <= 0:
                break
            victims.append(lid)
            excess -= len(v.block_ids)
        return [self._free(lid, Freed.EVICTED) for lid in victims]
