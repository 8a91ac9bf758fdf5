"""One push WRITE in flight on P's transfer thread (push_write.py runs them).

Its transfers, posted whole or layer by layer (`layer_push.Posting`, chosen when it
started), end in one of two ways: complete (D told where the posting did not already,
counted), or failed. A WRITE that fails while some of its transfers may still be in flight
(its timeout, P's preemption) is fenced first (`Transport.drop_agent` on D's agents) and
failed, freeing P's blocks and telling D, only once the transport reports every transfer
ended: D reuses its blocks on that word (protocol/push_receive.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvferry.connectors.protocol import messages, timeline
from kvferry.connectors.transfer.layer_push import Fences, Posting
from kvferry.connectors.transfer.stats import Stats
from kvferry.connectors.transfer.transport import FENCE_S, Transfer, Transport, XferState

log = logging.getLogger("vllm." + __name__)


@dataclass
class WriteJob:
    """A WRITE of ``tid`` to every D rank it goes to, from start to its end."""

    tid: str
    posting: Posting  # whole or layer by layer
    xfers: list[Transfer]  # one per D rank written and batch of layers posted
    started: float  # monotonic: failed once recv_timeout_s passed
    ended_at: float  # wall clock of the prefill's end (0: unknown)
    fenced: tuple[float, str, str] | None = None  # (since, why, detail): failing once ended
    check: messages.Register | None = None  # D asked for our blocks' sums (verify.py)
    src: tuple[int, ...] = ()  # P's blocks written, in D's order

    def post(self, transport: Transport, fences: Fences) -> None:
        """Post what the posting may post now (layers whose fence passed). Raises."""
        self.xfers += self.posting.post(transport, fences)

    def fence(self, transport: Transport, stats: Stats, why: str, detail: str) -> bool:
        """Fence the transfers still in flight (D's agents dropped); False: none is, so
        the WRITE may fail at once."""
        if all(transport.poll(x) != XferState.PROC for x in self.xfers):
            return False
        self.fenced = (time.monotonic(), why, detail)
        stats.event("transfers_fenced", self.tid)
        for agent in {x.peer for x in self.xfers if x.state == XferState.PROC}:
            transport.drop_agent(agent)
        return True

    def fence_over(self, transport: Transport, stats: Stats, now: float) -> bool:
        """A fenced WRITE's transfers all ended (or `FENCE_S` passed without a word:
        counted as ``transfers_unfenced``)."""
        assert self.fenced is not None
        state = transport.poll_all(self.xfers)
        if state == XferState.PROC and now < self.fenced[0] + FENCE_S:
            return False
        if state == XferState.PROC:
            stats.event("transfers_unfenced", self.tid)
        return True

    def release(self, transport: Transport) -> None:
        for x in self.xfers:
            transport.release(x)

    def complete(self, transport: Transport, stats: Stats) -> None:
        """Every transfer landed: tell D (layer by layer: now), count the WRITE."""
        self.posting.commit(transport, stats)
        timeline.mark(log, self.tid, "write_done")
        nbytes = sum(x.nbytes for x in self.xfers)
        after = (time.time() - self.ended_at) * 1e3 if self.ended_at else float("nan")
        log.info("kvferry WRITE %s: %d B in %d descriptors, %.1f ms; done %.1f ms after the "
                 "prefill ended", self.tid, nbytes, sum(x.ndesc for x in self.xfers),
                 (time.monotonic() - self.started) * 1e3, after)
        stats.event("writes_done", self.tid)
        stats.add("bytes_written", nbytes)
