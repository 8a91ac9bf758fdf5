"""Recently ended transfer ids, so a late or duplicate event is recognised, not taken for new.

Shared by both sides of push (`push_match.PushMatcher`, `push_receive.PushReceiver`):
bounded in time (``ttl`` seconds after the end) and in count (oldest dropped first).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum


class End(StrEnum):
    """How a transfer ended (its value is what `state()` and messages say)."""

    DONE = "done"  # P: written
    ABORTED = "aborted"
    HOLD_TIMEOUT = "hold_timeout"  # P: no registration in time
    REGISTER_TIMEOUT = "register_timeout"  # P: no prefill in time
    WRITE_FAILED = "write_failed"
    INVALID = "invalid"
    READY = "ready"  # D: every P rank's WRITE landed
    REJECTED = "rejected"  # D: P acknowledged it writes nothing (more)
    RELEASED = "released"  # D: quarantine over


@dataclass(frozen=True)
class Ended:
    """How and when an id ended: a late event for it is answered, not taken for a new one."""

    reason: End
    at: float
    owners: frozenset[str] = frozenset()  # P: whose prefill_done was seen (and freed)


class Tombstones:
    """Recently ended ids, bounded in time and count."""

    def __init__(self, ttl: float, max_entries: int) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._d: OrderedDict[str, Ended] = OrderedDict()

    def add(self, key: str, ended: Ended) -> None:
        self._d.pop(key, None)
        self._d[key] = ended
        while len(self._d) > self.max_entries:
            self._d.popitem(last=False)

    def get(self, key: str) -> Ended | None:
        return self._d.get(key)

    def sweep(self, now: float) -> None:
        for key, e in list(self._d.items()):
            if e.at == -math.inf:  # ended before any clock was seen: start its TTL now
                self._d[key] = Ended(e.reason, now, e.owners)
            elif now - e.at >= self.ttl:
                del self._d[key]
            else:
                break

    def __len__(self) -> int:
        return len(self._d)
