"""Push, P, on the transfer thread: carry out `PushSender`'s decisions, WRITE to D.

`PushSender` (protocol/push_sender.py) decides which WRITE starts (whole or layer by layer),
which blocks are freed and which registration is rejected; this part feeds it events (step
metadata, forward and layer fences, D's messages, transfer outcomes) and executes its
actions, off the engine loop. Every outcome reaches vLLM as a finished send (P frees its
blocks), and D hears a `Rejected` whenever its registration will not be served. Each
WRITE in flight is a `push_job.WriteJob` (fenced before it fails while in flight).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvferry.connectors.config import ConnectorConfig
from kvferry.connectors.protocol import messages, push_sender, timeline
from kvferry.connectors.protocol.params import mac_ok
from kvferry.connectors.protocol.push_sender import PushSender, SendAction
from kvferry.connectors.protocol.step import StepMeta
from kvferry.connectors.transfer import layer_push, verify
from kvferry.connectors.transfer.layer_push import Fences, Forwards, LayerFence, Ready
from kvferry.connectors.transfer.push_job import WriteJob
from kvferry.connectors.transfer.rank_io import RankIO, RankPart
from kvferry.connectors.transfer.transport import XferState

log = logging.getLogger("vllm." + __name__)


class PushWrite(RankPart):
    """P's push WRITEs for one rank: the I/O around a `PushSender`."""

    def __init__(self, cfg: ConnectorConfig, io: RankIO, steps: Callable[[], int],
                 drain: Callable[[], None]) -> None:
        """``steps``: engine steps begun so far; ``drain``: act on every step's metadata
        queued so far (an early push must see whether the next step preempted it)."""
        super().__init__(io)
        self._steps, self._drain = steps, drain
        layout = self.transport.layout
        self.layerwise = cfg.layerwise_push and layer_push.layerwise_possible(layout, self.transport.backends)
        self.sender = PushSender(layout.block_size, layout.num_blocks,
                                 hold_timeout=cfg.push_hold_timeout_s,
                                 register_timeout=cfg.push_register_timeout_s,
                                 write_timeout=cfg.recv_timeout_s, layerwise=self.layerwise)
        self.matcher = self.sender.matcher
        self._writes: dict[str, WriteJob] = {}
        self._forwards = Forwards()  # whole-forward fences, per step
        self._fences = Fences()  # layer fences, per step

    def busy(self) -> bool:
        """A WRITE in flight, or a forward whose prompts may be written once it is done."""
        return bool(self._writes) or self.sender.busy()

    def awaiting(self) -> bool:
        """A registration is expected (or a transfer is under way)."""
        return self.sender.awaiting()

    @property
    def num_tracked(self) -> int:
        """Transfers this rank holds any state for (0: nothing left behind)."""
        return self.sender.num_tracked + len(self._writes) + len(self._fences) + len(self._forwards)

    @property
    def num_unfinished(self) -> int:
        """Early-pushed prefills the scheduler has not finished yet."""
        return self.sender.num_unfinished

    def ready(self, r: Ready) -> None:
        """Step ``r.step``'s forward computed the last tokens of ``r.items``."""
        self._forwards.add(r)
        self.sender.forward(r.items, r.step)

    def layer_fence(self, f: LayerFence) -> None:
        """Layer-wise push: a layer of step ``f.step`` is written once ``f.fence`` passes."""
        if f.step in self.sender.gate_steps():
            self._fences.add(f)
            self.stats.add("layer_fences")

    def accept(self, meta: StepMeta, now: float, step: int = 0) -> None:
        """A step's metadata; ``step``: the engine step it belongs to."""
        self._run(self.sender.step_meta(meta, step, now))

    def on_message(self, msg: messages.Register | messages.Abort, now: float) -> None:
        if isinstance(msg, messages.Abort):
            self._run(self.sender.aborted(msg.transfer_id, now))
            return
        if not mac_ok(msg, msg.sig):
            log.warning("push %s: ignoring an unsigned or forged registration", msg.transfer_id)
            self.stats.event("registrations_forged", msg.transfer_id)
            return
        self.stats.event("registrations", msg.transfer_id, msg.engine_id)
        log.info("push %s: registration from %s (%d blocks from token %d)", msg.transfer_id,
                 msg.engine_id, len(msg.block_ids), msg.first_token)
        self._run(self.sender.registered(msg, now))

    def progress(self, now: float) -> None:
        if len(self._forwards) or self.sender.busy():  # early push, or a gate to open
            steps, passed = self._steps(), self._forwards.passed()
            if self.sender.must_drain(steps, passed):
                self._drain()  # the next step's meta may say a request was preempted
            self._run(self.sender.poll(steps, passed, now))
            self._forwards.keep_only(self.sender.forward_steps())
        for tid, wr in list(self._writes.items()):
            if wr.fenced is not None:
                if wr.fence_over(self.transport, self.stats, now):
                    self._fail(tid, *wr.fenced[1:])
                continue
            late = now >= wr.started + self.sender.write_timeout
            try:
                wr.post(self.transport, self._fences)
            except Exception as e:
                self._abandon(tid, f"not posted: {e}")
                continue
            if not wr.posting.committable():  # layers to post, or the gate closed
                if late:
                    self._abandon(tid, "timed out")
                continue
            state = self.transport.poll_all(wr.xfers)
            if state == XferState.DONE:
                self._done(tid, wr, now)
            elif state != XferState.PROC or late:
                self._abandon(tid, "timed out" if state == XferState.PROC else "error")
        if len(self._fences):
            self._fences.keep_only(self.sender.gate_steps() | {
                s for w in self._writes.values() if (s := w.posting.fence_step) is not None})
        self._run(self.sender.tick(now))

    def _run(self, actions: list[SendAction]) -> None:
        for a in actions:
            if isinstance(a, push_sender.Write):
                self._start(a)
            elif isinstance(a, push_sender.Free):
                if a.report:
                    self.out.report(sent={a.owner})
                if a.refused:
                    log.warning("push %s: request %s refused (%s)", a.transfer_id, a.owner, a.refused)
            elif isinstance(a, push_sender.RejectD):
                if a.counted:
                    log.info("push %s: rejecting D's registration: %s", a.transfer_id, a.reason)
                    self.stats.event("rejections", a.transfer_id, a.reason)
                if a.reg is not None:
                    self._notify_d(a.reg, messages.Rejected(a.transfer_id, a.reason, self.ranks.rank))
            elif isinstance(a, push_sender.FailWrite):
                self._abandon(a.transfer_id, a.reason, a.detail)
            elif isinstance(a, push_sender.Mark):
                timeline.mark(log, a.transfer_id, a.what)

    def _notify_d(self, reg: messages.Register, msg: messages.Message) -> None:
        try:
            ranks = self.ranks.write_ranks(reg.tp_size, reg.rank)
        except ValueError:
            ranks = [reg.rank]
        for d in ranks:
            self.peers.tell_rank(reg.host, reg.port, d, msg, reg.engine_id)

    def _start(self, a: push_sender.Write) -> None:
        s, reg = a.start, a.reg
        try:  # (peer, head segments) of every D rank we write: one WRITE each
            dests = [(self.peers.at(reg.host, reg.port, reg.engine_id, d)[1],
                      self.ranks.write_segments(reg.tp_size, d))
                     for d in self.ranks.write_ranks(reg.tp_size, reg.rank)]
            self.mirror.stage_out(s.src_block_ids)  # host staging: the WRITE reads our mirror
            note = messages.encode(messages.Wrote(s.transfer_id, self.ranks.rank))
            posting = layer_push.posting_for(a.gate, dests, s.src_block_ids, s.dest_block_ids[0],
                                             note, len(self.transport.layout.layers))
            xfers = posting.start(self.transport)
        except Exception as e:
            self._fail(s.transfer_id, str(e), f"not started: {e}")
            return
        timeline.mark(log, s.transfer_id, "write_start")
        wr = self._writes[s.transfer_id] = WriteJob(s.transfer_id, posting, xfers,
                                                    time.monotonic(), a.ended_at)
        if reg.checksums:
            wr.check, wr.src = reg, tuple(s.src_block_ids)

    def _abandon(self, tid: str, why: str, detail: str = "") -> None:
        """Fail the WRITE once none of its transfers can still land: at once when none
        is in flight, else after fencing them (D's agents dropped) and hearing they ended."""
        wr = self._writes.get(tid)
        if wr is not None and wr.fenced is not None:
            return  # failing already, once its transfers ended
        if wr is None or not wr.fence(self.transport, self.stats, why, detail):
            self._fail(tid, why, detail)

    def _fail(self, tid: str, why: str, detail: str = "") -> None:
        """End a WRITE that did not complete (or start): NIXL aborts what is in flight on
        release; the sender frees P's blocks (or defers it to the request's end), rejects D."""
        if (wr := self._writes.pop(tid, None)) is not None:
            wr.release(self.transport)
        log.warning("push %s: WRITE failed: %s", tid, detail or why)
        self.stats.event("writes_failed", tid, detail or why)
        self._run(self.sender.write_failed(tid, why, time.monotonic()))

    def _done(self, tid: str, wr: WriteJob, now: float) -> None:
        del self._writes[tid]
        wr.complete(self.transport, self.stats)
        if wr.check is not None:  # D compares what landed with our blocks, not yet freed
            self._notify_d(wr.check, verify.source_sums(self.sums, tid, self.ranks.rank, wr.src))
        self._run(self.sender.write_done(tid, now))
