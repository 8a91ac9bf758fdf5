"""Read timeouts of the legs' open answers, checked a few times per timeout instead of a
loop timer re-armed on every chunk (a measurable share of the token path's CPU)."""

from __future__ import annotations

import asyncio
from typing import Protocol

WATCH_MAX_S = 1.0
"""The longest time between two looks."""


class Watched(Protocol):
    """An answer the watchdog times (router/wire/engine_conn.py `StreamResponse`)."""

    limit: float | None
    """Seconds without bytes after which it is closed (ReadTimeout)."""

    def idle_for(self, now: float) -> float:
        """Seconds since it last grew, as far as the watchdog's looks tell."""
        ...

    def expire(self) -> None:
        """No bytes for `limit` seconds: close it."""
        ...


class Watchdog:
    """Read timeouts of open streams, checked a few times per timeout instead of a loop
    timer re-armed on every chunk; a stream whose body did not grow for its limit is
    closed (ReadTimeout). It looks every quarter limit and dates growth by its looks (a new
    stream's count starts at its first look), so a stalled stream ends between 1x and 1.5x
    its limit after its last bytes."""

    def __init__(self) -> None:
        self._streams: set[Watched] = set()
        self._task: asyncio.Task[None] | None = None
        self._period = WATCH_MAX_S

    def add(self, s: Watched) -> None:
        """Watch `s` (its count starts at the watchdog's next look)."""
        self._streams.add(s)
        assert s.limit is not None
        if s.limit < 4 * self._period:
            self._period = max(0.01, s.limit / 4)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def discard(self, s: Watched) -> None:
        self._streams.discard(s)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._streams:
            await asyncio.sleep(self._period)
            now = loop.time()
            for s in [s for s in self._streams if s.limit and s.idle_for(now) > s.limit]:
                self._streams.discard(s)
                s.expire()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

