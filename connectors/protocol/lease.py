"""Leases on D: keep a finished turn's KV blocks for the next turn, and free them safely.

After a turn D keeps the request's blocks so P can READ them for turn N+1 instead of
recomputing the whole history. Holding blocks costs decode capacity, so the hold is a
lease: it expires ``ttl`` seconds after the last grant/renewal (``decoder_kv_blocks_ttl``,
480 s), a heartbeat can renew it up to ``max_lifetime``, and an explicit release ends it
as soon as the conversation does. A READ in flight pins the lease: its blocks are never
freed under a running READ, even if the lease expires or is released meanwhile.

Pure state machine: no I/O, no clocks (``now`` is passed in). Every lease's blocks are
reported in exactly one `FreeBlocks`; the glue frees them by ``req_id``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_TTL = 480.0  # decoder_kv_blocks_ttl


class LeaseError(Exception):
    """An operation on a lease that cannot be honoured; ``reason`` is machine-readable:
    unknown | expired | released | expiring | duplicate | not_reading | too_large |
    no_capacity | invalid."""

    def __init__(self, lease_id: str, reason: str, detail: str = "") -> None:
        self.lease_id = lease_id
        self.reason = reason
        super().__init__(f"lease {lease_id!r}: {reason}" + (f" ({detail})" if detail else ""))


@dataclass(frozen=True)
class FreeBlocks:
    """D may free this lease's blocks now (once per lease)."""

    lease_id: str
    req_id: str
    block_ids: tuple[int, ...]
    reason: str  # released | expired | evicted | read_timeout


@dataclass(frozen=True)
class Lease:
    """A read-only view of one lease."""

    lease_id: str
    req_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    prefix_hashes: tuple[str, ...]
    granted_at: float
    expiry: float
    deadline: float  # granted_at + max_lifetime: renewals never go past it


@dataclass
class _Held:
    view: Lease
    pins: list[float] = field(default_factory=list)  # begin_read times, oldest first
    released: bool = False


class LeaseTable:
    """All leases of one D engine, bounded by ``max_blocks`` held blocks."""

    def __init__(
        self,
        ttl: float = DEFAULT_TTL,
        *,
        max_lifetime: float = 3600.0,
        max_blocks: int | None = None,
        read_timeout: float | None = 120.0,
        tombstone_ttl: float = 3600.0,
        max_tombstones: int = 100_000,
    ) -> None:
        """``read_timeout``: a pin older than this is dropped by `tick` (a P that died
        mid-READ must not pin blocks forever); it must exceed the transport's transfer
        timeout so a dropped pin's READ has surely stopped. None disables it."""
        if ttl <= 0 or max_lifetime <= 0:
            raise ValueError("ttl and max_lifetime must be positive")
        self.ttl = ttl
        self.max_lifetime = max_lifetime
        self.max_blocks = max_blocks
        self.read_timeout = read_timeout
        self._held: OrderedDict[str, _Held] = OrderedDict()  # LRU: least recent first
        self._num_blocks = 0
        self._ended: OrderedDict[str, tuple[str, float]] = OrderedDict()
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
            raise LeaseError(lease_id, "duplicate", "lease ids must never be reused")
        if num_tokens < 0 or any(b < 0 for b in blocks):
            raise LeaseError(lease_id, "invalid", "negative token count or block id")
        freed = self._sweep(now)
        if self.max_blocks is not None:
            if len(blocks) > self.max_blocks:
                raise LeaseError(lease_id, "too_large",
                                 f"{len(blocks)} blocks > max_blocks {self.max_blocks}")
            freed += self._make_room(lease_id, len(blocks))
        deadline = now + self.max_lifetime
        view = Lease(lease_id, req_id, blocks, num_tokens, tuple(prefix_hashes), now,
                     min(now + min(self.ttl, ttl or self.ttl), deadline), deadline)
        self._held[lease_id] = _Held(view)
        self._num_blocks += len(blocks)
        return view.expiry, freed

    def renew(self, lease_id: str, now: float, ttl: float | None = None) -> float:
        """Heartbeat: extend to ``now + ttl`` (never shortens, never past the deadline)."""
        self._now = max(self._now, now)
        h = self._live(lease_id, now)
        v = h.view
        expiry = max(v.expiry, min(now + (self.ttl if ttl is None else ttl), v.deadline))
        h.view = Lease(v.lease_id, v.req_id, v.block_ids, v.num_tokens, v.prefix_hashes,
                       v.granted_at, expiry, v.deadline)
        self._held.move_to_end(lease_id)
        return expiry

    def release(self, lease_id: str, now: float | None = None) -> list[FreeBlocks]:
        """End the lease now (conversation over, router dropped it). Frees at once unless
        a READ is in flight; then its `end_read` frees."""
        if now is not None:
            self._now = max(self._now, now)
        h = self._get(lease_id)
        if h.released:
            raise LeaseError(lease_id, "released", "already released, READ still in flight")
        h.released = True
        if h.pins:
            return []
        return [self._free(lease_id, "released")]

    def begin_read(self, lease_id: str, now: float, margin: float = 0.0) -> Lease:
        """Pin the lease for one READ, if it outlives ``now + margin`` (strictly).

        The margin covers the READ's duration: a lease is never read once
        ``now >= expiry - margin``.
        """
        self._now = max(self._now, now)
        h = self._live(lease_id, now)
        if now + margin >= h.view.expiry:
            raise LeaseError(lease_id, "expiring",
                             f"expires at {h.view.expiry}, read needs until {now + margin}")
        h.pins.append(now)
        self._held.move_to_end(lease_id)
        return h.view

    def end_read(self, lease_id: str, now: float | None = None) -> list[FreeBlocks]:
        """One READ finished (or failed). Frees a released lease, or an expired one when
        ``now`` is given (otherwise the next `tick` does)."""
        if now is not None:
            self._now = max(self._now, now)
        h = self._get(lease_id)
        if not h.pins:
            raise LeaseError(lease_id, "not_reading", "end_read without begin_read")
        h.pins.pop(0)
        if h.pins:
            return []
        if h.released:
            return [self._free(lease_id, "released")]
        if now is not None and now >= h.view.expiry:
            return [self._free(lease_id, "expired")]
        return []

    def tick(self, now: float) -> list[FreeBlocks]:
        """Free expired or released leases no READ pins; drop pins past ``read_timeout``."""
        self._now = max(self._now, now)
        return self._sweep(now)

    # -- inspection -----------------------------------------------------------------

    def get(self, lease_id: str) -> Lease | None:
        h = self._held.get(lease_id)
        return None if h is None else h.view

    def is_pinned(self, lease_id: str) -> bool:
        h = self._held.get(lease_id)
        return h is not None and bool(h.pins)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    @property
    def num_blocks(self) -> int:
        """Blocks held by leases (including expired/released ones a READ still pins)."""
        return self._num_blocks

    # -- internals ------------------------------------------------------------------

    def _get(self, lease_id: str) -> _Held:
        h = self._held.get(lease_id)
        if h is None:
            ended = self._ended.get(lease_id)
            if ended is not None:
                raise LeaseError(lease_id, ended[0], "lease already ended and freed")
            raise LeaseError(lease_id, "unknown")
        return h

    def _live(self, lease_id: str, now: float) -> _Held:
        h = self._get(lease_id)
        if h.released:
            raise LeaseError(lease_id, "released")
        if now >= h.view.expiry:
            raise LeaseError(lease_id, "expired", f"expired at {h.view.expiry}")
        return h

    def _free(self, lease_id: str, reason: str) -> FreeBlocks:
        h = self._held.pop(lease_id)
        self._num_blocks -= len(h.view.block_ids)
        # Tombstone reason for later calls: expired leases say "expired", others "released".
        self._ended[lease_id] = ("expired" if reason == "expired" else "released", self._now)
        while len(self._ended) > self._max_tombstones:
            self._ended.popitem(last=False)
        return FreeBlocks(lease_id, h.view.req_id, h.view.block_ids, reason)

    def _sweep(self, now: float) -> list[FreeBlocks]:
        out: list[FreeBlocks] = []
        for lid, h in list(self._held.items()):
            reason = "expired" if now >= h.view.expiry else "released"
            if self.read_timeout is not None and h.pins:
                h.pins = [t for t in h.pins if now - t < self.read_timeout]
                if not h.pins and (h.released or now >= h.view.expiry):
                    reason = "read_timeout"
            if not h.pins and (h.released or now >= h.view.expiry):
                out.append(self._free(lid, reason))
        for lid, (_, at) in list(self._ended.items()):
            if now - at < self._tombstone_ttl:
                break
            del self._ended[lid]
        return out

    def _make_room(self, lease_id: str, need: int) -> list[FreeBlocks]:
        assert self.max_blocks is not None
        excess = self._num_blocks + need - self.max_blocks
        if excess <= 0:
            return []
        victims: list[str] = []
        for lid, h in self._held.items():  # least recently used first
            if excess <= 0:
                break
            if not h.pins:
                victims.append(lid)
                excess -= len(h.view.block_ids)
        if excess > 0:
            raise LeaseError(lease_id, "no_capacity",
                             f"{need} blocks do not fit: READs pin the rest")
        return [self._free(lid, "evicted") for lid in victims]
