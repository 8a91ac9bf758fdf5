"""Push, D, on the transfer thread: register destination blocks with P, wait for its WRITE.

For each `RegisterTask` D fetches P's handshake (cached), sends a signed `Register`
notification with its destination blocks to the P ranks it leads, and waits in a
`PushReceiver` for every writing P rank's `Wrote`. Every outcome reaches vLLM as a
finished receive (decode, or recompute with the blocks reported bad), and D reuses
destination blocks only when no WRITE can still land: every writing P rank said its WRITE
ended (`Wrote` or `Rejected`), or P's WRITE timeout plus the quarantine passed since D gave
up (protocol/push_receive.py has the argument). While it waits that long for a P that
does not answer, D checks every `PROBE_S` whether P's side channel still listens: a port
that refuses the connection means P's process is gone, and a WRITE of a process that is
gone cannot land, so the blocks go then.

A checked WRITE (transfer/verify.py) is received only once P's `Sums` of its source
blocks equal D's destination blocks' (else, or without an answer, D recomputes).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvferry.connectors.config import ConnectorConfig
from kvferry.connectors.protocol import messages, timeline
from kvferry.connectors.protocol.params import mac
from kvferry.connectors.protocol.push_receive import (
    Cause,
    PushReceiver,
    RecvAction,
    RecvFailed,
    RecvReady,
    ReleaseDest,
)
from kvferry.connectors.protocol.step import RegisterTask, StepMeta
from kvferry.connectors.transfer import faults, verify
from kvferry.connectors.transfer.peers import gone
from kvferry.connectors.transfer.rank_io import RankIO, RankPart

log = logging.getLogger("vllm." + __name__)

TICK_S = 0.05  # time out waiting transfers at most this often
PROBE_S = 1.0  # how often a quarantine waiting on a silent P checks that P still exists



@dataclass
class _DReq:
    """D: one registered transfer."""

    req_id: str
    block_ids: list[int]
    host: str
    port: int
    ready: bool = False
    registered_at: float = 0.0  # monotonic
    p_ranks: list[int] = field(default_factory=list)  # P ranks we registered with
    writers: set[int] = field(default_factory=set)  # P ranks whose WRITE we wait for
    check: verify.Expected | None = None  # P's Sums, compared once every WRITE ended
    written: int = 0  # how many of block_ids P writes (the tokens from first_token)


class PushRecv(RankPart):
    """D's push registrations for one rank: the I/O around a `PushReceiver`."""

    def __init__(self, cfg: ConnectorConfig, engine_id: str, io: RankIO) -> None:
        super().__init__(io)
        self.cfg = cfg
        self.engine_id = engine_id
        # A WRITE P started before our abort reached it may run until P's WRITE timeout
        # (recv_timeout_s, same config) ends it: blocks are never reused before that.
        self.receiver = PushReceiver(recv_timeout=cfg.push_recv_timeout_s,
                                     quarantine=cfg.recv_timeout_s + cfg.push_quarantine_s)
        self._d: dict[str, _DReq] = {}
        self._checking: dict[str, _DReq] = {}  # written, awaiting or comparing P's Sums
        self._last_tick = 0.0
        self._last_probe = 0.0

    def awaiting(self) -> bool:
        """A Wrote or Sums notification is expected."""
        return bool(self._d or self._checking)

    @property
    def num_tracked(self) -> int:
        """Registered transfers not yet settled."""
        return len(self._d) + len(self._checking)

    # -- from the engine's step metadata -------------------------------------------------
    def accept(self, meta: StepMeta, now: float) -> None:
        for task in meta.register:
            self._register(task, now)
        for tid in meta.push_abort_d:
            d = self._d.get(tid)
            self._apply(self.receiver.abort(tid, now))
            if d is not None:
                self._tell_p(d, messages.Abort(tid))
            # else: never registered (nothing allocated or still unknown to P): P's hold
            # timeout frees its blocks; nothing to wait for here.

    def _register(self, task: RegisterTask, now: float) -> None:
        layout = self.transport.layout
        if task.transfer_id in self._d:
            # Another live request of ours already waits on this transfer id (a replayed
            # request): P will write only the first one's blocks. Recompute at once.
            log.warning("request %s: transfer id %s is already in use here; recomputing",
                        task.req_id, task.transfer_id)
            self.stats.event("recomputes", task.req_id, "transfer id in use here")
            self.out.report(recvd={task.req_id}, bad_blocks=task.block_ids)
            return
        d = self._d[task.transfer_id] = _DReq(
            task.req_id, task.block_ids, task.host, task.port, registered_at=now,
            written=-(-task.num_tokens // layout.block_size) - task.first_token // layout.block_size)
        reg = messages.Register(
            transfer_id=task.transfer_id, engine_id=self.engine_id,
            host=self.cfg.side_channel_host, port=self.cfg.side_channel_port, rank=self.ranks.rank,
            block_ids=task.block_ids, block_size=layout.block_size, num_blocks=layout.num_blocks,
            first_token=task.first_token, num_tokens=task.num_tokens, prompt_hash=task.prompt_hash,
            tp_size=self.ranks.tp_size)
        try:
            p_tp = self.peers.tp(task.host, task.port)
            expect, d.p_ranks, idle = self.ranks.push_targets(p_tp)
        except Exception as e:  # P unreachable or an impossible split: no WRITE can land
            expect, idle, failure = {self.ranks.rank}, [], e
        else:
            failure = None
            if self._check_wanted(task.req_id, p_tp):
                d.check, reg.checksums = verify.Expected(), True
        reg.sig = mac(reg)
        d.writers = set(expect)
        self._apply(self.receiver.expect(task.transfer_id, task.req_id, expect, now))
        sent: list[int] = []
        try:
            if failure is not None:
                raise failure
            for p in d.p_ranks:
                _, peer = self.peers.at(task.host, task.port, rank=p)
                self.transport.notify(peer, messages.encode(reg))
                sent.append(p)
        except Exception as e:
            log.warning("request %s: push registration with %s:%d failed (%s); recomputing",
                        task.req_id, task.host, task.port, e)
            for p in set(d.p_ranks or [0]) - set(sent):
                self.peers.drop(task.host, task.port, rank=p)
            if not sent:  # P never saw us, so no WRITE can land
                self._apply(self.receiver.rejected(task.transfer_id, f"registration failed: {e}",
                                                   now))
            else:  # some P ranks may write: wait them out, and ask them not to
                unsent, d.p_ranks = set(d.p_ranks) - set(sent), sent
                self._apply(self.receiver.failed(task.transfer_id, f"registration failed: {e}",
                                                 now))
                for p in unsent & expect:  # only we register with them: they never write
                    self._apply(self.receiver.rejected(task.transfer_id, "not registered",
                                                       now, p))
            return
        for p in idle:  # a replica nobody reads: its blocks may go now
            self.peers.tell_rank(task.host, task.port, p, messages.Abort(task.transfer_id))
        timeline.mark(log, task.transfer_id, "registered")
        log.debug("push %s: registered %d blocks with %s:%d", task.transfer_id,
                  len(task.block_ids), task.host, task.port)

    def _check_wanted(self, req_id: str, p_tp: int) -> bool:
        """Whether this transfer's WRITE is checked (unchecked when it cannot be: counted)."""
        if not verify.wanted(self.cfg.kv_checksums, self.cfg.kv_checksum_fraction, req_id):
            return False
        why = ("head segments (another TP size)" if p_tp != self.ranks.tp_size
               else "" if self.sums.available else self.sums.why_not)
        if why:
            self.stats.event("checksums_unchecked", req_id, why)
        return not why

    def _tell_p(self, d: _DReq, msg: messages.Message) -> None:
        """Every P rank we registered with (none: another of our ranks did)."""
        for p in d.p_ranks:
            self.peers.tell_rank(d.host, d.port, p, msg)

    def _apply(self, actions: list[RecvAction]) -> None:
        for a in actions:
            d = self._d.get(a.transfer_id)
            if isinstance(a, RecvReady):
                if d is None:
                    self.out.report(recvd={a.req_id})
                    continue
                del self._d[a.transfer_id]
                if faults.ACTIVE:
                    self._corrupt(d)
                if d.check is None:
                    self._deliver(a.transfer_id, d)
                else:  # no WRITE can land any more: compare once P's Sums are here
                    d.check.start(time.monotonic())
                    self._checking[a.transfer_id] = d
            elif isinstance(a, RecvFailed):
                log.warning("push %s (request %s): %s; recomputing once no WRITE can land",
                            a.transfer_id, a.req_id, a.reason)
                self.stats.event("push_failed", a.transfer_id, a.reason)
                self.stats.event("recomputes", a.req_id, "push failed")
                # P's own Reject needs no Abort back, unless other P ranks may still write
                if d is not None and (a.cause is not Cause.REJECTED or len(d.p_ranks) > 1):
                    self._tell_p(d, messages.Abort(a.transfer_id))
            elif isinstance(a, ReleaseDest):
                self._d.pop(a.transfer_id, None)
                self.out.report(recvd={a.req_id}, bad_blocks=d.block_ids if d else ())

    def _deliver(self, tid: str, d: _DReq) -> None:
        """Every WRITE landed (and its check passed): the request decodes."""
        timeline.mark(log, tid, "kv_in")
        d.ready = True
        log.info("push %s: KV in, %.1f ms after registering", tid,
                 (time.monotonic() - d.registered_at) * 1e3)
        self.stats.event("push_received", tid)
        ok = self.mirror.stage_in(d.req_id, d.block_ids)  # host staging: mirror -> device
        self.out.report(recvd={d.req_id}, bad_blocks=() if ok else d.block_ids)

    def _corrupt(self, d: _DReq) -> None:
        """Chaos (faults.py's ``corrupt``): a byte the WRITE got wrong, checked or not."""
        if d.block_ids and self.sums.available and faults.hit("corrupt"):
            self.sums.flip_byte(d.block_ids[0])
            self.stats.event("corruptions_injected", d.req_id)

    def _poll_checks(self, now: float) -> None:
        for tid, d in list(self._checking.items()):
            assert d.check is not None
            try:
                ended, why = d.check.poll(lambda d=d: self.sums.sums(d.block_ids[:d.written]), now)
            except Exception as e:  # our memory unreadable: unchecked, delivered
                self.stats.event("checksums_unchecked", d.req_id, f"{type(e).__name__}: {e}")
                ended, why = True, None
            if not ended:
                continue
            del self._checking[tid]
            if why is None:
                self.stats.event("checksums_verified", d.req_id,
                                 f"{(time.monotonic() - (d.check.started or now)) * 1e3:.3f} ms")
                self._deliver(tid, d)
                continue
            name = "checksums_unanswered" if why.startswith("unanswered") else "checksum_mismatches"
            log.warning("push %s (request %s): KV checksum %s; recomputing", tid, d.req_id, why)
            self.stats.event(name, d.req_id, why)
            self.stats.event("recomputes", d.req_id, f"checksum {why}")
            self.out.report(recvd={d.req_id}, bad_blocks=d.block_ids)

    # -- from P ---------------------------------------------------------------------------
    def on_message(self, msg: messages.Wrote | messages.Sums | messages.Rejected,
                   now: float) -> None:
        if isinstance(msg, messages.Wrote):
            self._apply(self.receiver.notified(msg.transfer_id, msg.rank))
        elif isinstance(msg, messages.Sums):
            d = self._d.get(msg.transfer_id) or self._checking.get(msg.transfer_id)
            if d is not None and d.check is not None and msg.rank in d.writers:
                d.check.given(msg)
        elif (d := self._checking.get(msg.transfer_id)) is not None and d.check is not None:
            d.check.error = f"P rejected it after its WRITE: {msg.reason}"
        else:
            self._apply(self.receiver.rejected(msg.transfer_id, msg.reason, now,
                                               msg.rank if msg.rank >= 0 else None))

    def progress(self, now: float) -> None:
        if now - self._last_tick >= TICK_S:
            self._last_tick = now
            self._apply(self.receiver.tick(now))
        if self._checking:
            self._poll_checks(now)
        if now - self._last_probe >= PROBE_S:
            self._last_probe = now
            self._probe_quarantined(now)

    def _probe_quarantined(self, now: float) -> None:
        """Release quarantined blocks whose writing P ranks' processes are all gone."""
        dead: dict[tuple[str, int], bool] = {}
        for tid, d in list(self._d.items()):
            if self.receiver.state(tid) != "quarantined" or not d.writers:
                continue
            addrs = [(d.host, d.port + p) for p in d.writers]
            for a in addrs:
                if a not in dead:
                    dead[a] = gone(*a)
            if all(dead[a] for a in addrs):
                self.stats.event("push_writer_gone", tid)
                self._apply(self.receiver.rejected(tid, "P's process is gone", now))
