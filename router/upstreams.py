"""Upstream pools: least-in-flight choice with round-robin tie breaking.

The router runs on one asyncio loop, so choosing and incrementing happen without an await
in between and need no lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import Gauge


@dataclass
class Upstream:
    """One engine's base URL and the requests the router currently has open on it."""

    url: str
    in_flight: int = 0


class UpstreamPool:
    """Picks the upstream with the fewest open requests; ties rotate round-robin."""

    def __init__(self, role: str, urls: list[str], gauge: Gauge | None = None) -> None:
        if not urls:
            raise ValueError(f"{role} pool needs at least one URL")
        self.role = role
        self.upstreams = [Upstream(url) for url in urls]
        self._next = 0
        self._gauge = gauge
        for up in self.upstreams:
            self._set_gauge(up)

    def choose(self) -> Upstream:
        """Least-loaded upstream, scanning from a rotating start so ties spread evenly."""
        n = len(self.upstreams)
        best: Upstream | None = None
        for i in range(n):
            up = self.upstreams[(self._next + i) % n]
            if best is None or up.in_flight < best.in_flight:
                best = up
        assert best is not None
        self._next = (self.upstreams.index(best) + 1) % n
        return best

    def choose_sticky(self, preferred: str | None) -> Upstream:
        """`preferred` (where a conversation's KV is) unless it is gone or overloaded."""
        if preferred is None:
            return self.choose()
        from .registry import choose_decode

        url = choose_decode(preferred, {u.url: u.in_flight for u in self.upstreams})
        return next((u for u in self.upstreams if u.url == url), None) or self.choose()

    def acquire(self, up: Upstream) -> None:
        """Count a request as open on `up`."""
        up.in_flight += 1
        self._set_gauge(up)

    def release(self, up: Upstream) -> None:
        """Count a request on `up` as finished (success, failure or cancellation)."""
        up.in_flight = max(0, up.in_flight - 1)
        self._set_gauge(up)

    @contextmanager
    def lease(self, up: Upstream | None = None) -> Iterator[Upstream]:
        """Choose (unless given) and hold an upstream for the duration of the block."""
        chosen = up or self.choose()
        self.acquire(chosen)
        try:
            yield chosen
        finally:
            self.release(chosen)

    def _set_gauge(self, up: Upstream) -> None:
        if self._gauge is not None:
            self._gauge.labels(role=self.role, upstream=up.url).set(up.in_flight)
