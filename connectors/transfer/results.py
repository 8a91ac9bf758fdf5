"""What the transfer thread reports to the engine thread, and the hand-over between them."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class Results:
    """Requests whose sends finished (P frees their blocks), whose receives finished (D
    decodes, P's reuse READ ended), and blocks whose load failed (recompute them)."""

    sent: set[str] = field(default_factory=set)
    recvd: set[str] = field(default_factory=set)
    bad_blocks: set[int] = field(default_factory=set)

    def any(self) -> bool:
        return bool(self.sent or self.recvd or self.bad_blocks)


class ResultBox:
    """Results the transfer thread reported and the engine thread has not taken yet."""

    def __init__(self) -> None:
        self._ready = threading.Condition(threading.Lock())  # signalled by report()
        self._out = Results()

    def report(self, sent: set[str] = frozenset(), recvd: set[str] = frozenset(),
               bad_blocks: Iterable[int] = ()) -> None:
        with self._ready:
            self._out.sent |= sent
            self._out.recvd |= recvd
            self._out.bad_blocks.update(bad_blocks)
            if self._out.any():
                self._ready.notify_all()

    def take(self, wait_s: float = 0.0) -> Results:
        """Everything reported since the last call; with ``wait_s``, first wait up to that
        long for something to be reported (an engine step with nothing to compute)."""
        with self._ready:
            if wait_s > 0 and not self._out.any():
                self._ready.wait(wait_s)
            out, self._out = self._out, Results()
        return out
