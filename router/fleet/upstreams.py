"""Upstream pools: least-in-flight choice with round-robin tie breaking, over the engines
that are healthy.

The router runs on one asyncio loop, so choosing and incrementing happen without an await
in between and need no lock.

Membership changes at run time (discovery, `set_urls`): a vanished engine stops getting
work at once; requests already holding its `Upstream` finish and release it normally.
Health: `failed` counts consecutive failures (probes and requests alike) and ejects the
engine at `eject_after`; `refused` (a connection refused) ejects it at once; `answered`
re-admits it. When every engine is ejected the pool
still chooses among all of them: trying is better than refusing for sure.
With health probes on, an engine starts as "starting" (engines take tens of seconds to
load, the router two): it gets work only when no engine is healthy, its failures eject
nothing (no ejection and re-admission of every engine at each start), and its first good
answer makes it healthy.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from prometheus_client import Gauge

from ..errors import RouterError
from ..metrics import RouterMetrics


class NoUpstream(RouterError):
    """The pool has no engine at all (discovery found none yet, or all vanished)."""

    def __init__(self, role: str) -> None:
        super().__init__(503, f"no {role} engine available", "service_unavailable", role,
                         "no_upstream")


@dataclass
class Upstream:
    """One engine's base URL and the requests the router currently has open on it."""

    url: str
    name: str = ""  # what /metrics and operators call it (`UpstreamPool.name_of`)
    in_flight: int = 0
    healthy: bool = True
    failures: int = 0  # consecutive
    starting: bool = False  # not answered well yet (health probes on)

    @property
    def state(self) -> str:
        """"starting", "healthy" or "ejected"."""
        return "starting" if self.starting else "healthy" if self.healthy else "ejected"

    @property
    def serving(self) -> bool:
        return self.healthy and not self.starting


class UpstreamPool:
    """Picks the upstream with the fewest open requests; ties rotate round-robin."""

    def __init__(self, role: str, urls: list[str], gauge: Gauge | None = None,
                 *, allow_empty: bool = False, eject_after: int = 3,
                 metrics: RouterMetrics | None = None, starting: bool = False) -> None:
        if not urls and not allow_empty:
            raise ValueError(f"{role} pool needs at least one URL")
        self.role = role
        self._starting = starting  # engines start as "starting" (health probes on)
        self._names: dict[str, str] = {}
        self.upstreams = [self._new(url) for url in urls]
        self.eject_after = eject_after
        self._next = 0
        self._gauge = gauge
        self._metrics = metrics
        for up in self.upstreams:
            self._set_gauge(up)
        self._set_health_gauges()

    def choose(self, exclude: Collection[str] = ()) -> Upstream:
        """Least-loaded healthy upstream (not in `exclude`), scanning from a rotating
        start so ties spread evenly. `NoUpstream` when there is none at all."""
        ups = [u for u in self.upstreams if u.url not in exclude]
        if not ups:
            raise NoUpstream(self.role)
        healthy = [u for u in ups if u.serving] or ups
        n = len(self.upstreams)
        best: Upstream | None = None
        for i in range(n):
            up = self.upstreams[(self._next + i) % n]
            if up in healthy and (best is None or up.in_flight < best.in_flight):
                best = up
        assert best is not None
        self._next = (self.upstreams.index(best) + 1) % n
        return best

    def name_of(self, url: str) -> str:
        """The engine's name: its role and the order the router first saw it in
        (``decode-0``, ``decode-1``; an engine that leaves and comes back keeps its name).
        Metrics carry names, never addresses: /metrics is served on the client port, and
        only the operator's /health maps names to URLs."""
        if (name := self._names.get(url)) is None:
            name = self._names[url] = f"{self.role}-{len(self._names)}"
        return name

    def _new(self, url: str) -> Upstream:
        return Upstream(url, self.name_of(url), starting=self._starting)

    def get(self, url: str) -> Upstream | None:
        return next((u for u in self.upstreams if u.url == url), None)

    def member(self, url: str) -> bool:
        """`url` is in the pool, ejected or not. A conversation's KV on an ejected engine
        may still be readable (an engine that was restarting, or missed probes while busy):
        P tries, and any failure is a recompute; on an engine that left the pool it is gone."""
        return self.get(url) is not None

    def healthy_count(self, exclude: Collection[str] = ()) -> int:
        return sum(1 for u in self.upstreams if u.serving and u.url not in exclude)

    # -- membership and health ---------------------------------------------------------
    def set_urls(self, urls: list[str]) -> tuple[list[str], list[str]]:
        """Make the pool exactly `urls` (order kept); returns (added, removed)."""
        have = {u.url: u for u in self.upstreams}
        added = [u for u in urls if u not in have]
        removed = [u for u in have if u not in urls]
        self.upstreams = [have.get(u) or self._new(u) for u in dict.fromkeys(urls)]
        self._next = 0
        for url in removed:
            self._forget(url)
        for up in self.upstreams:
            if up.url in added:
                self._set_gauge(up)
        self._set_health_gauges()
        return added, removed

    def failed(self, up: Upstream) -> bool:
        """Count a failure (probe or request); True if it ejected the engine just now."""
        up.failures += 1
        return not up.starting and up.failures >= self.eject_after and self._eject(up)

    def refused(self, up: Upstream) -> bool:
        """The engine refused a connection: no process listens there (killed, not up yet),
        so it is ejected now rather than after `eject_after` failures; a probe answered
        200 re-admits it. True if it ejected the engine just now."""
        up.failures = max(up.failures + 1, self.eject_after)
        return not up.starting and self._eject(up)

    def _eject(self, up: Upstream) -> bool:
        if not up.healthy:
            return False
        up.healthy = False
        if self._metrics is not None:
            self._metrics.ejections.labels(role=self.role, upstream=up.name).inc()
        self._set_health_gauges()
        return True

    def answered(self, up: Upstream) -> bool:
        """The engine answered well; True if that re-admitted it."""
        up.failures = 0
        if up.starting:
            up.starting = False
            self._set_health_gauges()
            return False
        if up.healthy:
            return False
        up.healthy = True
        if self._metrics is not None and up in self.upstreams:
            self._metrics.readmissions.labels(role=self.role, upstream=up.name).inc()
        self._set_health_gauges()
        return True

    def _set_health_gauges(self) -> None:
        if self._metrics is None:
            return
        self._metrics.upstreams.labels(role=self.role).set(len(self.upstreams))
        for up in self.upstreams:
            self._metrics.upstream_healthy.labels(role=self.role, upstream=up.name).set(
                1 if up.serving else 0)

    def _forget(self, url: str) -> None:
        for gauge in (self._gauge, self._metrics and self._metrics.upstream_healthy):
            if gauge is not None:
                with suppress(KeyError):
                    gauge.remove(self.role, self.name_of(url))

    def choose_sticky(self, preferred: str | None) -> Upstream:
        """`preferred` (where a conversation's KV is) unless it is gone or overloaded."""
        if preferred is None:
            return self.choose()
        url = choose_decode(preferred, {u.url: u.in_flight for u in self.upstreams},
                            healthy={u.url for u in self.upstreams if u.serving})
        return self.get(url) if url is not None else self.choose()

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
        if self._gauge is not None and up in self.upstreams:
            self._gauge.labels(role=self.role, upstream=up.name).set(up.in_flight)


def choose_decode(
    preferred: str | None,
    loads: Mapping[str, float],
    *,
    healthy: Collection[str] | None = None,
    factor: float = 2.0,
    slack: float = 2.0,
) -> str | None:
    """Pick a D: stick to ``preferred`` (where the conversation's KV is) unless it is
    unhealthy or its in-flight load exceeds ``max(factor * least, least + slack)``;
    otherwise the least loaded healthy D (ties by name). ``slack`` keeps stickiness when
    the least loaded D is idle (factor * 0 would always move). None if no D is healthy.
    """
    cands = [d for d in loads if healthy is None or d in healthy]
    if not cands:
        return None
    least = min(cands, key=lambda d: (loads[d], d))
    lo = loads[least]
    if preferred is not None and preferred in cands and loads[preferred] <= max(factor * lo, lo + slack):
        return preferred
    return least
