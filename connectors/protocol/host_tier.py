"""D's host-memory tier for leased conversation KV (issue 34): where a lease goes instead
of ending when HBM presses it out or its HBM term runs out.

The pool is ``num_slots`` block-sized slots of one pinned host region registered with NIXL
once. A lease that would end in HBM is *spilled*: `spill` picks slots (evicting the least
recently used idle entries if it must, all or nothing), the glue copies the blocks
device -> host, and only once `spilled` says the copy is done does the entry become
readable and may D free the HBM blocks. P then READs the slots with the same signed-offer
protocol as HBM blocks (`offer` pins them for the READ's grace, as `LeaseKeeper` delays
an HBM free). A slot under a READ is never handed out again before the READ's grace ends;
a full pool or an entry too large refuses the spill, and the next turn recomputes, as
without a tier.

Pure state machine: no I/O, no clocks (``now`` is passed in). Every slot is, at any time,
free, owned by one entry, or draining (its entry ended while a READ may still run); each
allocation's slots come back in exactly one `SlotsFreed`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from enum import StrEnum

from .lease import Lease


class TierEnd(StrEnum):
    """Why a host entry's slots came back."""

    RELEASED = "released"
    EXPIRED = "expired"
    EVICTED = "evicted"  # the least recently used, for a newer spill
    COPY_FAILED = "copy_failed"  # the device -> host copy did not finish: never readable


class TierRefusal(StrEnum):
    """Why an operation on the tier cannot be honoured."""

    UNKNOWN = "unknown"  # no such entry (never spilled, or ended)
    NOT_READY = "not_ready"  # its copy is still running
    EXPIRED = "expired"
    DUPLICATE = "duplicate"


class TierError(Exception):
    def __init__(self, lease_id: str, reason: TierRefusal) -> None:
        self.lease_id, self.reason = lease_id, reason
        super().__init__(f"host entry {lease_id!r}: {reason}")


@dataclass(frozen=True)
class Spill:
    """Copy ``block_ids`` (HBM) to ``slots`` (host), in order, then call `spilled`."""

    lease_id: str
    req_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]


@dataclass(frozen=True)
class SlotsFreed:
    """These slots may be handed out again (once per allocation)."""

    lease_id: str
    slots: tuple[int, ...]
    reason: TierEnd


@dataclass(frozen=True)
class HostEntry:
    """A read-only view of one spilled lease: what the next turn's offer names."""

    lease_id: str
    slots: tuple[int, ...]
    num_tokens: int
    prefix_hashes: tuple[str, ...]
    ready: bool  # the copy finished: readable
    expiry: float
    deadline: float  # the HBM lease's: renewals never go past it
    held_until: float  # a READ of it may run until then: not evicted, slots not reused


class HostTier:
    """The host entries of one D engine (one TP rank's pool; every rank plans alike)."""

    def __init__(self, num_slots: int, ttl: float) -> None:
        if num_slots < 0 or ttl <= 0:
            raise ValueError("num_slots must be >= 0 and ttl positive")
        self.num_slots = num_slots
        self.ttl = ttl
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest
        self._entries: OrderedDict[str, HostEntry] = OrderedDict()  # LRU: least recent first
        self._draining: list[tuple[float, SlotsFreed]] = []  # ended while a READ may run
        self._req: dict[str, str] = {}
        self._ending: set[str] = set()  # released while their copy runs

    # -- operations -------------------------------------------------------------------

    def spill(self, lease: Lease, now: float) -> tuple[Spill | None, list[SlotsFreed]]:
        """Plan to keep ``lease`` (ending in HBM) in host memory: (the copy to make, entries
        evicted for room). None, and nothing evicted, when it cannot fit: the pool is
        smaller than the lease, or held entries (copying, or under a READ) leave no room."""
        if lease.lease_id in self._entries:
            raise TierError(lease.lease_id, TierRefusal.DUPLICATE)
        freed = self.tick(now)
        need = len(lease.block_ids)
        victims = self._victims(need - len(self._free), now)
        if victims is None:
            return None, freed
        for lid in victims:
            freed += self._end(lid, TierEnd.EVICTED, now)
        slots = tuple(self._free.pop() for _ in range(need))
        self._entries[lease.lease_id] = HostEntry(
            lease.lease_id, slots, lease.num_tokens, lease.prefix_hashes, False,
            min(now + self.ttl, lease.deadline), lease.deadline, float("-inf"))
        self._req[lease.lease_id] = lease.req_id
        return Spill(lease.lease_id, lease.req_id, lease.block_ids, slots), freed

    def spilled(self, lease_id: str, now: float) -> tuple[HostEntry | None, list[SlotsFreed]]:
        """The copy finished: the entry is readable for the tier's TTL from now. An entry
        released while its copy ran ends now instead: (None, its slots)."""
        e = self._copying(lease_id)
        if lease_id in self._ending:
            self._ending.discard(lease_id)
            return None, self._end(lease_id, TierEnd.RELEASED, now)
        e = replace(e, ready=True, expiry=max(e.expiry, min(now + self.ttl, e.deadline)))
        self._entries[lease_id] = e
        self._entries.move_to_end(lease_id)
        return e, []

    def copy_failed(self, lease_id: str, now: float) -> list[SlotsFreed]:
        """The copy failed: the slots come back now (nothing could have read them)."""
        self._copying(lease_id)
        self._ending.discard(lease_id)
        return self._end(lease_id, TierEnd.COPY_FAILED, now)

    def offer(self, lease_id: str, now: float, hold_s: float) -> HostEntry:
        """A READ of the entry may start: its slots stay untouched for ``hold_s`` (the
        READ's timeout plus margin), even if the entry ends meanwhile."""
        e = self._live(lease_id, now)
        e = replace(e, held_until=max(e.held_until, now + hold_s))
        self._entries[lease_id] = e
        self._entries.move_to_end(lease_id)
        return e

    def renew(self, lease_id: str, now: float, ttl: float | None = None) -> float:
        """Heartbeat: extend to ``now + ttl`` (never shortens, never past the deadline; a
        copy still running is renewed too)."""
        e = self._get(lease_id)
        if lease_id in self._ending:
            raise TierError(lease_id, TierRefusal.UNKNOWN)
        if e.ready and now >= e.expiry:
            raise TierError(lease_id, TierRefusal.EXPIRED)
        expiry = max(e.expiry, min(now + (self.ttl if ttl is None else ttl), e.deadline))
        self._entries[lease_id] = replace(e, expiry=expiry)
        self._entries.move_to_end(lease_id)
        return expiry

    def release(self, lease_id: str, now: float) -> list[SlotsFreed]:
        """The conversation is over: the entry ends (its slots once no READ may run, and
        not before its copy finished: the copy still writes them)."""
        if not self._get(lease_id).ready:
            self._ending.add(lease_id)
            return []
        return self._end(lease_id, TierEnd.RELEASED, now)

    def tick(self, now: float) -> list[SlotsFreed]:
        """End expired entries; hand back slots whose READ grace passed."""
        out: list[SlotsFreed] = []
        for lid, e in list(self._entries.items()):
            if e.ready and now >= e.expiry:
                out += self._end(lid, TierEnd.EXPIRED, now)
        keep = []
        for until, f in self._draining:
            if now >= until:
                self._free.extend(f.slots)
                out.append(f)
            else:
                keep.append((until, f))
        self._draining = keep
        return out

    # -- inspection -------------------------------------------------------------------

    def get(self, lease_id: str) -> HostEntry | None:
        return self._entries.get(lease_id)

    def req_id(self, lease_id: str) -> str | None:
        return self._req.get(lease_id)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_draining(self) -> int:
        return sum(len(f.slots) for _, f in self._draining)

    # -- internals --------------------------------------------------------------------

    def _get(self, lease_id: str) -> HostEntry:
        e = self._entries.get(lease_id)
        if e is None:
            raise TierError(lease_id, TierRefusal.UNKNOWN)
        return e

    def _copying(self, lease_id: str) -> HostEntry:
        e = self._get(lease_id)
        if e.ready:
            raise TierError(lease_id, TierRefusal.DUPLICATE)
        return e

    def _live(self, lease_id: str, now: float) -> HostEntry:
        e = self._get(lease_id)
        if not e.ready:
            raise TierError(lease_id, TierRefusal.NOT_READY)
        if now >= e.expiry:
            raise TierError(lease_id, TierRefusal.EXPIRED)
        return e

    def _victims(self, short: int, now: float) -> list[str] | None:
        """Least recently used idle entries whose slots cover ``short``; None if too few."""
        victims: list[str] = []
        for lid, e in self._entries.items():
            if short <= 0:
                break
            if e.ready and e.held_until <= now:
                victims.append(lid)
                short -= len(e.slots)
        return victims if short <= 0 else None

    def _end(self, lease_id: str, reason: TierEnd, now: float) -> list[SlotsFreed]:
        e = self._entries.pop(lease_id)
        del self._req[lease_id]
        f = SlotsFreed(lease_id, e.slots, reason)
        if e.held_until > now:
            self._draining.append((e.held_until, f))
            return []
        self._free.extend(e.slots)
        return [f]

