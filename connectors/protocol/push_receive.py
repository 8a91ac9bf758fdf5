"""Push protocol, D side: readiness from per-rank WRITE notifications, safe reuse after failure.

The request is ready only when every writing P rank notified. A destination block of a
transfer that failed, timed out or was aborted on D may still receive a late WRITE, so it
stays *quarantined* (the glue keeps it allocated) and `ReleaseDest` says when it may be
reused. Pure, like `push_match` (P's side).

Why a late WRITE can never land in a block that belongs to another request:

1. A P rank WRITEs only blocks of a registration it matched under the transfer id, and
   never after it ended that id (P's tombstone: a registration or abort after the end is
   refused), so a WRITE is always for this `_Expect` and ends, on P, in exactly one of: its
   transport reported DONE (P sends `Wrote` after the data: whole WRITEs carry it on the
   NIXL transfer itself, layer-wise ones send it once every layer is DONE), or it failed,
   was never started, or was given up at P's WRITE timeout and released (P sends
   `Rejected`).
2. D's blocks are released (`ReleaseDest`) only when every writing rank has said so
   (`Wrote` or `Rejected`: `settled`), or when the grace period after D gave up passed.
   D counts that period from its own failure or abort, and it is
   ``recv_timeout + quarantine`` in the worker (push_recv.py): a WRITE P started before
   D's abort reached it is released by P at the latest its WRITE timeout (recv_timeout_s)
   after it started, which was before the abort arrived; ``quarantine`` covers that
   delivery. A rank D never registered with cannot write and counts as rejected.
3. A D rank's transfer id is live for one request at a time (push_recv.py refuses a
   second), and an ended id is tombstoned (`expect` of a stale id releases at once,
   before anything is registered), so a `Wrote` or WRITE for an earlier request of the
   same id cannot release or touch a later one's blocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from kvferry.connectors.protocol.push_match import TOMBSTONE_TTL_S
from kvferry.connectors.protocol.tombstones import End, Ended, Tombstones

RECV_TIMEOUT_S = 180.0  # push_recv_timeout_s: > P's register timeout + the WRITE
QUARANTINE_S = 10.0  # push_quarantine_s: how long a WRITE P started may still land


@dataclass(frozen=True)
class RecvReady:
    """Every writing P rank notified: D may schedule the request for decode."""

    transfer_id: str
    req_id: str


class Cause(Enum):
    """Why a transfer failed on D, which decides whom D still has to tell."""

    STALE = "stale"  # the id ended before: P will never write it
    FAILED = "failed"  # D gave up (registration failed): P may still write, ask it not to
    REJECTED = "rejected"  # P said it writes nothing (more): other P ranks may still
    TIMED_OUT = "timed_out"  # no WRITE in time: ask P to stop


@dataclass(frozen=True)
class RecvFailed:
    """The KV will not (all) arrive: D must recompute. Destination blocks stay held
    until the matching `ReleaseDest`."""

    transfer_id: str
    req_id: str
    reason: str
    cause: Cause = Cause.FAILED


@dataclass(frozen=True)
class ReleaseDest:
    """No WRITE for this transfer can land any more: its destination blocks may be reused."""

    transfer_id: str
    req_id: str
    reason: str


RecvAction = RecvReady | RecvFailed | ReleaseDest


@dataclass
class _Expect:
    req_id: str
    p_ranks: frozenset[int]
    since: float
    notified: set[int] = field(default_factory=set)
    rejected: set[int] = field(default_factory=set)  # ranks that promised no (more) WRITE
    quarantine_until: float | None = None  # set: failed/aborted, waiting out late WRITEs

    def settled(self) -> bool:
        """No WRITE can still land: every rank rejected or finished writing."""
        return self.p_ranks <= self.rejected | self.notified


class PushReceiver:
    """D side: readiness from per-rank WRITE notifications, and safe reuse after failure.

    Each ``expect`` ends in exactly one `RecvReady` or exactly one `ReleaseDest`
    (preceded by one `RecvFailed` unless D itself aborted the request).
    """

    def __init__(
        self,
        *,
        recv_timeout: float = RECV_TIMEOUT_S,
        quarantine: float = QUARANTINE_S,
        tombstone_ttl: float = TOMBSTONE_TTL_S,
        max_tombstones: int = 100_000,
    ) -> None:
        """``recv_timeout`` should exceed P's ``register_timeout`` plus the write time, so
        P's Reject normally arrives first; ``quarantine`` bounds how long a WRITE that P
        already started may take to land after D gave up."""
        self.recv_timeout = recv_timeout
        self.quarantine = quarantine
        self._live: dict[str, _Expect] = {}
        self._ended = Tombstones(tombstone_ttl, max_tombstones)
        self._now = -math.inf

    def expect(self, transfer_id: str, req_id: str, p_ranks: Iterable[int], now: float
               ) -> list[RecvAction]:
        """D registered destination blocks and waits for WRITEs from ``p_ranks``."""
        self._now = max(self._now, now)
        ranks = frozenset(p_ranks)
        if not ranks:
            raise ValueError("p_ranks must not be empty")
        if transfer_id in self._live:
            return []
        if (e := self._ended.get(transfer_id)) is not None:
            # A reused id: P has tombstoned or served it and will never write it again.
            return [RecvFailed(transfer_id, req_id, f"stale transfer id ({e.reason})", Cause.STALE),
                    ReleaseDest(transfer_id, req_id, "stale transfer id")]
        self._live[transfer_id] = _Expect(req_id, ranks, now)
        return []

    def notified(self, transfer_id: str, rank: int) -> list[RecvAction]:
        """P rank ``rank`` reported its WRITE for ``transfer_id`` complete."""
        x = self._live.get(transfer_id)
        if x is None or rank not in x.p_ranks:
            return []  # unknown or foreign: never makes anything ready
        if x.quarantine_until is not None:  # abandoned: never ready, but maybe settled
            x.notified.add(rank)
            return self._release_if_settled(transfer_id, x)
        x.notified.add(rank)
        if x.notified != x.p_ranks:
            return []
        del self._live[transfer_id]
        self._ended.add(transfer_id, Ended(End.READY, self._now))
        return [RecvReady(transfer_id, x.req_id)]

    def failed(self, transfer_id: str, reason: str, now: float
               ) -> list[RecvAction]:
        """D-side failure: recompute, but keep the blocks until late WRITEs cannot land."""
        self._now = max(self._now, now)
        x = self._live.get(transfer_id)
        if x is None or x.quarantine_until is not None:
            return []
        x.quarantine_until = now + self.quarantine
        return [RecvFailed(transfer_id, x.req_id, reason)]

    def rejected(self, transfer_id: str, reason: str, now: float, rank: int | None = None
                 ) -> list[RecvAction]:
        """P's Reject (from rank ``rank``; None: all of P): it will write nothing (more).
        The blocks are safe at once when no other writing rank may still WRITE; else
        they stay quarantined until those ranks reject or finish too, or time passes."""
        self._now = max(self._now, now)
        x = self._live.get(transfer_id)
        if x is None:
            return []
        x.rejected |= set(x.p_ranks) if rank is None else {rank} & x.p_ranks
        out: list[RecvAction] = []
        if x.quarantine_until is None:
            x.quarantine_until = now + self.quarantine
            out.append(RecvFailed(transfer_id, x.req_id, f"rejected by P: {reason}", Cause.REJECTED))
        return out + self._release_if_settled(transfer_id, x)

    def _release_if_settled(self, transfer_id: str, x: _Expect) -> list[RecvAction]:
        """An abandoned transfer whose every writer rejected or finished: nothing can land."""
        if x.quarantine_until is None or not x.settled():
            return []
        del self._live[transfer_id]
        self._ended.add(transfer_id, Ended(End.REJECTED, self._now))
        return [ReleaseDest(transfer_id, x.req_id, "P acknowledged")]

    def abort(self, transfer_id: str, now: float) -> list[RecvAction]:
        """D's request was cancelled: quarantine its blocks (no RecvFailed: nobody waits)."""
        self._now = max(self._now, now)
        x = self._live.get(transfer_id)
        if x is None or x.quarantine_until is not None:
            return []
        x.quarantine_until = now + self.quarantine
        return []

    def tick(self, now: float) -> list[RecvAction]:
        """Time out waiting transfers; release quarantined blocks whose grace period passed."""
        self._now = max(self._now, now)
        out: list[RecvAction] = []
        for tid, x in list(self._live.items()):
            if x.quarantine_until is None and now - x.since >= self.recv_timeout:
                x.quarantine_until = now + self.quarantine
                out.append(RecvFailed(tid, x.req_id, "timed out waiting for P's WRITE", Cause.TIMED_OUT))
            if x.quarantine_until is not None and now >= x.quarantine_until:
                del self._live[tid]
                self._ended.add(tid, Ended(End.RELEASED, self._now))
                out.append(ReleaseDest(tid, x.req_id, "quarantine over"))
        self._ended.sweep(now)
        return out

    def state(self, transfer_id: str) -> str:
        """waiting | quarantined | ended:<reason> | unknown."""
        if (x := self._live.get(transfer_id)) is not None:
            return "waiting" if x.quarantine_until is None else "quarantined"
        if (e := self._ended.get(transfer_id)) is not None:
            return f"ended:{e.reason}"
        return "unknown"

    @property
    def num_live(self) -> int:
        return len(self._live)
