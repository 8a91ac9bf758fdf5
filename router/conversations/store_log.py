"""Warnings of a failing conversation store, throttled: every request would log one."""

from __future__ import annotations

import logging
import time

LOG_EVERY_S = 10.0


class ThrottledLog:
    """A warning at most every `LOG_EVERY_S`, saying how many were held back since: a
    failing store would otherwise log once per request."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self._last = 0.0
        self._suppressed = 0

    def warning(self, msg: str) -> None:
        now = time.monotonic()
        if now - self._last < LOG_EVERY_S:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more since last report)" if self._suppressed else ""
        self.logger.warning("%s%s", msg, more)
        self._last, self._suppressed = now, 0
