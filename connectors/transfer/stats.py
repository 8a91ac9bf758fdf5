"""Transfer counters of one engine rank, served live on its side channel (`b"stats"`).

Tests and operators ask an engine what it moved instead of reading its log: every place
that logs a READ, a WRITE or a fallback also counts it here. Besides the totals, a short
ring of recent events names the request or transfer id (and why, for failures), so a
test can ask "did P finish the WRITE of transfer X" without scraping text. Pure (no
zmq/nixl): the side channel and the tests both use it.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Iterable

import msgspec

# Every counter a snapshot carries (0 until counted). Event counters also record an event.
COUNTERS = (
    "reads_done",  # D: pull READs of P's blocks that completed (one per D rank and request)
    "reads_failed",  # D: pull READs that failed, timed out or could not start
    "bytes_read",
    "reuse_reads_done",  # P: READs of D's leased blocks (conversation reuse)
    "reuse_reads_failed",
    "writes_done",  # P: push WRITEs into D's blocks (one per P rank and transfer)
    "writes_failed",
    "bytes_written",
    "layered_writes",  # P: push WRITEs posted layer by layer (layerwise_push), completed
    "layers_posted_early",  # P: ... their layers posted before the whole forward was done
    "layer_batches",  # P: ... WRITE batches posted for them (one per poll with new layers)
    "layer_fences",  # P: layers save_kv_layer reported in steps completing a push prompt
    "registrations",  # P: signed push registrations received from D
    "registrations_forged",  # P: unsigned or forged registrations ignored
    "rejections",  # P: registrations refused (D recomputes)
    "push_received",  # D: pushed KV complete (every P rank's Wrote)
    "push_failed",  # D: a push that ended without the KV
    "push_writer_gone",  # D: a quarantined push released early: P's side channel refused
    "recomputes",  # either side: a request falls back to computing the KV itself
    "transfers_fenced",  # READs/WRITEs still running past their deadline: peer agent dropped
    "transfers_unfenced",  # ... that reported no end FENCE_S after that (given up on anyway)
    "checksums_verified",  # READs/push WRITEs whose blocks' checksums equal the source's
    "checksum_mismatches",  # ... that differed: the request recomputes
    "checksums_unanswered",  # ... whose source did not answer in time: recomputes too
    "checksums_unchecked",  # transfers chosen for a check that could not have one
    "corruptions_injected",  # chaos only: bytes flipped in received blocks (faults.py)
    "sends_expired",  # P: no decode read an offer's KV within send_timeout_s
    "sends_released",  # P: the router said no decode will read an offer's KV (D refused it)
    "notifications",  # NIXL notifications received
    "notifications_bad",  # ... that were not kvferry messages
    "thread_errors",  # exceptions the transfer thread caught (logged with a traceback)
)
MAX_EVENTS = 1024  # per rank: enough for every request of a test module, bounded for a server


class Event(msgspec.Struct, array_like=True, frozen=True):
    """One counted event of a transfer, served (a bounded list) on the side channel with the counters."""

    name: str  # the counter it incremented
    key: str  # request id (READs) or transfer id (push)
    detail: str = ""  # why, for failures
    rank: int = 0
    seq: int = 0  # per rank: events recorded before this one


class Snapshot(msgspec.Struct, kw_only=True):
    """What one rank (or, merged, one engine) counted since it started."""

    counters: dict[str, int]  # required: a handshake payload is no snapshot
    engine_id: str = ""
    ranks: list[int] = msgspec.field(default_factory=list)
    events: list[Event] = msgspec.field(default_factory=list)  # oldest first, per rank
    events_dropped: int = 0  # older events no longer in the ring

    def __getitem__(self, name: str) -> int:
        return self.counters.get(name, 0)

    def find(self, name: str, key: str | None = None) -> list[Event]:
        return [e for e in self.events if e.name == name and (key is None or e.key == key)]

    def since(self, earlier: Snapshot) -> list[Event]:
        """Events recorded after ``earlier`` (a snapshot of the same ranks), per rank."""
        last: dict[int, int] = {}
        for e in earlier.events:
            last[e.rank] = max(last.get(e.rank, -1), e.seq)
        return [e for e in self.events if e.seq > last.get(e.rank, -1)]

    @classmethod
    def merge(cls, parts: Iterable[Snapshot]) -> Snapshot:
        """One engine's view: counters summed over its TP ranks, events concatenated."""
        out = cls(counters={})
        total: Counter[str] = Counter()
        for p in parts:
            out.engine_id = out.engine_id or p.engine_id
            out.ranks += p.ranks
            total.update(p.counters)
            out.events += p.events
            out.events_dropped += p.events_dropped
        out.counters = {name: total[name] for name in sorted({*COUNTERS, *total})}
        return out


class Stats:
    """Thread-safe counters: the transfer thread counts, the side-channel thread reads."""

    def __init__(self, engine_id: str = "", rank: int = 0):
        self.engine_id, self.rank = engine_id, rank
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._events: deque[Event] = deque(maxlen=MAX_EVENTS)
        self._seen = 0

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def event(self, name: str, key: str, detail: str = "") -> None:
        """Count ``name`` once and remember which request or transfer it was about."""
        with self._lock:
            self._counts[name] += 1
            self._events.append(Event(name, str(key), str(detail)[:300], self.rank, self._seen))
            self._seen += 1

    def snapshot(self) -> Snapshot:
        with self._lock:
            counts = {name: self._counts[name] for name in sorted({*COUNTERS, *self._counts})}
            return Snapshot(counters=counts, engine_id=self.engine_id, ranks=[self.rank],
                            events=list(self._events),
                            events_dropped=self._seen - len(self._events))

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self.snapshot())


def decode(blob: bytes) -> Snapshot:
    """A snapshot from the wire; msgspec.ValidationError/DecodeError if it is not one."""
    return msgspec.msgpack.decode(blob, type=Snapshot)
