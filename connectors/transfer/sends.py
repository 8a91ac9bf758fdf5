"""Pull, P: a finished prefill's blocks wait for D's READ, then are reported sent (freed).

The blocks go when every D rank reading this P rank said `Done`, or after the send
timeout when no D ever reads them. A Done can arrive before the scheduler's step naming
the request (D reads fast, P's step is late): it is remembered for as long.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from kvferry.connectors.protocol import messages
from kvferry.connectors.transfer.results import ResultBox
from kvferry.connectors.transfer.stats import Stats

log = logging.getLogger("vllm." + __name__)  # under vLLM's handlers


class Sends:
    """P's pulled prefills: blocks held until every D rank that reads them said Done, or
    the send timeout."""

    def __init__(self, out: ResultBox, send_timeout_s: float, stats: Stats) -> None:
        self.out = out
        self.stats = stats
        self.send_timeout_s = send_timeout_s
        self._waiting: dict[str, float] = {}  # req id -> free at the latest
        self._early: dict[str, float] = {}  # req id -> until when an early Done is kept
        self._dones: dict[str, tuple[int, float]] = {}  # notices so far, until when kept

    def hold(self, req_ids: Iterable[str], now: float) -> None:
        """The scheduler published offers for these requests' blocks."""
        for req_id in req_ids:
            if self._early.pop(req_id, None) is not None:
                self.out.report(sent={req_id})
            else:
                self._waiting[req_id] = now + self.send_timeout_s

    def on_done(self, msg: messages.Done, now: float) -> None:
        """A D rank is done with ``msg.req_id``'s blocks; they go after the last one."""
        count = self._dones.pop(msg.req_id, (0, 0.0))[0] + 1
        if count < msg.expect:
            self._dones[msg.req_id] = (count, now + self.send_timeout_s)
        elif self._waiting.pop(msg.req_id, None) is not None:
            self.out.report(sent={msg.req_id})
        else:
            self._early[msg.req_id] = now + self.send_timeout_s

    def release(self, req_id: str, now: float) -> None:
        """The router says no D will read ``req_id``'s blocks (D refused or failed the
        request): free them now, or as soon as the scheduler's step names the request."""
        self._dones.pop(req_id, None)
        self.stats.event("sends_released", req_id)
        if self._waiting.pop(req_id, None) is not None:
            self.out.report(sent={req_id})
        else:
            self._early[req_id] = now + self.send_timeout_s

    def expire(self, now: float) -> None:
        """Free what no D read in time; forget early and partial notices past their time."""
        for req_id, deadline in list(self._waiting.items()):
            if now >= deadline:
                log.warning("request %s: no decode read its KV within %.0fs; freeing",
                            req_id, self.send_timeout_s)
                self.stats.event("sends_expired", req_id)
                del self._waiting[req_id]
                self.out.report(sent={req_id})
        for req_id, deadline in list(self._early.items()):
            if now >= deadline:
                del self._early[req_id]
        for req_id, (_, deadline) in list(self._dones.items()):
            if now >= deadline:
                del self._dones[req_id]
