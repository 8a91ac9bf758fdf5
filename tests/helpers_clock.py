"""A clock the test moves by hand, for state machines that take ``now`` from a callable."""

from __future__ import annotations


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
