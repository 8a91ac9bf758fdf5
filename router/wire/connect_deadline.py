"""A connect timeout that counts only time the router could act in.

A loop that was busy (or a process that got no CPU) past a deadline runs its expired
timers before it polls the socket that connected long ago, so a plain timer would fail a
leg whose engine answered at once. `ConnectDeadline` waits in slices, does not count a
slice the loop woke from late, and lets the loop poll I/O before it fires.
"""

from __future__ import annotations

import asyncio

CONNECT_SLICE_S = 0.05
LATE_S = 0.02
"""A wait that ends more than this after its slice: the loop was late, not the engine."""


class ConnectDeadline:
    """Cancels the task sending a request once `limit_s` of time the router could act in
    has passed without a connection (made, or taken from the pool: `set`).

    Waits are sliced, and a slice the loop woke from late (it was busy, or the process got
    no CPU) does not count; at the end the loop is let poll I/O twice (two `call_soon`
    hops: each runs after the next poll), and a connection found made there counts as in
    time. Loop timers only, no task or future of its own: it is armed for every leg."""

    __slots__ = ("_loop", "_task", "_budget", "_step", "_t0", "_handle", "_done", "fired")

    def __init__(self, limit_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._budget = limit_s
        self._done = False
        self.fired = False
        self._handle: asyncio.TimerHandle | asyncio.Handle | None = None
        self._slice()

    def _slice(self) -> None:
        self._step = min(self._budget, CONNECT_SLICE_S)
        self._t0 = self._loop.time()
        self._handle = self._loop.call_later(self._step, self._tick)

    def _tick(self) -> None:
        if self._done:
            return
        elapsed = self._loop.time() - self._t0
        if elapsed <= self._step + LATE_S:  # on time: the router could have acted
            self._budget -= elapsed
        if self._budget > 0:
            self._slice()
        else:
            self._handle = self._loop.call_soon(self._hop)

    def _hop(self) -> None:
        if not self._done:
            self._handle = self._loop.call_soon(self._fire)

    def _fire(self) -> None:
        if not self._done and self._task is not None:
            self.fired = True
            self._done = True
            self._task.cancel()

    def set(self) -> None:
        """The request has its connection (stream_client's connector): no timeout any more."""
        self.stop()

    def stop(self) -> None:
        self._done = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
