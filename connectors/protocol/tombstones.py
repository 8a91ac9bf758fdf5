"""Recently ended transfer ids, so a late or duplicate event is recognised, not taken for new.

Shared by both sides of push (`push_match.PushMatcher`, `push_receive.PushReceiver`):
bounded in time (``ttl`` seconds after the end) and in count (oldest dropped first).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Ended:
    reason: str  # done | aborted | hold_timeout | register_timeout | write_failed | invalid
    had_prefill: bool  # a prefill_done was accepted (and its blocks freed)
    at: float
    owners: frozenset[str] = frozenset()  # whose prefill_done was seen (and freed)


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
                self._d[key] = Ended(e.reason, e.had_prefill, now, e.owners)
            elif now - e.at >= self.ttl:
                del self._d[key]
            else:
                break

    def __len__(self) -> int:
        return len(self._d)
