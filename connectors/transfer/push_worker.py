"""Push on the transfer thread: D registers, P writes. I/O glue around push_match.

D side: for each `RegisterTask` D fetches P's handshake (cached), sends a signed
`Register` notification with its destination blocks, and waits in a `PushReceiver` for
P's `Wrote`. P side: `PushMatcher` pairs registrations with finished prefills (either
order); the later event starts the WRITE here, on this thread, never on the engine loop.
Every outcome reaches vLLM as a finished send (P frees) or a finished receive (D decodes,
or recomputes with the blocks reported bad), and D reuses destination blocks only when no
WRITE can still land (P's rejection, or the quarantine after a timeout/abort).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvferry.connectors.protocol import messages, timeline
from kvferry.connectors.protocol.params import struct_sig, struct_sig_ok
from kvferry.connectors.protocol.push_match import (
    Destination,
    FreeBlocks,
    PushMatcher,
    PushReceiver,
    RecvFailed,
    RecvReady,
    Reject,
    ReleaseDest,
    StartWrite,
)
from kvferry.connectors.protocol.tp_map import plan, readers, writers
from kvferry.connectors.scheduling.scheduler import PushSend, RegisterTask, StepMeta
from kvferry.connectors.transfer.transport import Transfer

if TYPE_CHECKING:
    from kvferry.connectors.transfer.worker import TransferWorker

log = logging.getLogger("vllm." + __name__)


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


@dataclass
class _PReq:
    """P: one prefilled request and, once registered, where its KV goes."""

    req_id: str = ""
    prompt_hash: str = ""
    reg: messages.Register | None = None
    ended_at: float = 0.0  # wall clock when P's scheduler saw the prefill end


@dataclass
class Ready:
    """Early push: prompts completed by engine step ``step``, once ``fence`` passes."""

    items: list[PushSend]
    fence: Any  # .query() -> bool, or None (already complete)
    step: int

    def done(self, steps_begun: int) -> bool:
        return steps_begun > self.step and (self.fence is None or bool(self.fence.query()))


@dataclass
class _Write:
    xfers: list[Transfer]  # one per D rank written (several when D's TP size is smaller)
    deadline: float
    started: float
    ended_at: float  # wall clock of the prefill's end (0: unknown)


class PushEndpoint:
    def __init__(self, worker: TransferWorker):
        self.w = worker
        cfg = worker.cfg
        layout = worker.transport.layout
        self.matcher = PushMatcher(layout.block_size, layout.num_blocks,
                                   hold_timeout=cfg.push_hold_timeout_s,
                                   register_timeout=cfg.push_register_timeout_s)
        self.receiver = PushReceiver(recv_timeout=cfg.push_recv_timeout_s,
                                     quarantine=cfg.push_quarantine_s)
        self._d: dict[str, _DReq] = {}
        self._p: dict[str, _PReq] = {}
        self._writes: dict[str, _Write] = {}
        self._last_tick = 0.0
        # Early push: prompts waiting for their forward's fence (P's request id -> item,
        # batch); owners whose prefill was handed to the matcher before P's scheduler
        # finished the request; and which of those the matcher already freed (reported
        # only once the scheduler finished them: vLLM frees blocks of finished requests).
        self._ready: dict[str, tuple[PushSend, Ready]] = {}
        self._unfinished: set[str] = set()
        self._deferred: set[str] = set()

    def busy(self) -> bool:
        """A WRITE in flight, or a forward whose prompts may be written once it is done."""
        return bool(self._writes or self._ready)

    def ready(self, r: Ready) -> None:
        for s in r.items:
            self._ready[s.req_id] = (s, r)

    def _release_ready(self, now: float) -> None:
        """Early push: hand the matcher every prompt whose forward is complete."""
        steps = self.w.steps
        if not any(r.done(steps) for _, r in self._ready.values()):
            return
        self.w.drain_inbox()  # the next step's meta may say a request was preempted
        for req_id, (s, r) in list(self._ready.items()):
            if r.done(steps):
                del self._ready[req_id]
                timeline.mark(log, s.transfer_id, "forward_done")
                self._unfinished.add(req_id)
                self._prefill_done(s, now)

    def awaiting(self) -> bool:
        """A registration (P) or a Wrote notification (D) is expected."""
        return bool(self._d or self._p)

    # -- from the engine's step metadata -------------------------------------------------
    def accept(self, meta: StepMeta, now: float) -> None:
        for task in meta.register:
            self._register(task, now)
        for tid, req_id in meta.push_preempted:
            # vLLM freed the blocks (the gate in _release_ready kept any WRITE off them):
            # nothing to report freed; D is rejected and recomputes.
            self._ready.pop(req_id, None)
            self._run(self.matcher.abort(tid, now, owner=req_id))
        for s in meta.push_send:
            self._ready.pop(s.req_id, None)  # not yet released: the normal path now
            self._finished(s.req_id)
            self._prefill_done(s, now)  # a duplicate of an early push changes nothing
        for tid, req_id in meta.push_abort_p:
            if self._ready.pop(req_id, None) is not None:
                self.w.report(sent={req_id})  # held for a WRITE that never started
            self._finished(req_id)
            self._run(self.matcher.abort(tid, now, owner=req_id))
        for tid in meta.push_abort_d:
            d = self._d.get(tid)
            self._apply(self.receiver.abort(tid, now))
            if d is not None:
                self._tell_p(d, messages.Abort(tid))
            # else: never registered (nothing allocated or still unknown to P): P's hold
            # timeout frees its blocks; nothing to wait for here.

    def _prefill_done(self, s: PushSend, now: float) -> None:
        p = self._p.setdefault(s.transfer_id, _PReq())
        if not p.req_id:  # else another request holds this id: the matcher refuses us
            p.req_id, p.prompt_hash, p.ended_at = s.req_id, s.prompt_hash, s.ended_at
            if p.reg is not None and p.reg.prompt_hash != s.prompt_hash:
                self._run(self.matcher.abort(s.transfer_id, now))  # D registered another prompt
        self._run(self.matcher.prefill_done(s.transfer_id, s.transfer_id, s.block_ids,
                                            s.num_tokens, now, owner=s.req_id))

    def _finished(self, owner: str) -> None:
        """P's scheduler finished ``owner``: a free the matcher already decided is due."""
        self._unfinished.discard(owner)
        if owner in self._deferred:
            self._deferred.discard(owner)
            self.w.report(sent={owner})

    # -- D --------------------------------------------------------------------------------
    def _register(self, task: RegisterTask, now: float) -> None:
        layout = self.w.transport.layout
        if task.transfer_id in self._d:
            # Another live request of ours already waits on this transfer id (a replayed
            # request): P will write only the first one's blocks. Recompute at once.
            log.warning("request %s: transfer id %s is already in use here; recomputing",
                        task.req_id, task.transfer_id)
            self.w.stats.event("recomputes", task.req_id, "transfer id in use here")
            self.w.report(recvd={task.req_id}, bad_blocks=task.block_ids)
            return
        d = self._d[task.transfer_id] = _DReq(task.req_id, task.block_ids, task.host, task.port,
                                              registered_at=now)
        reg = messages.Register(
            transfer_id=task.transfer_id, engine_id=self.w.engine_id,
            host=self.w.cfg.side_channel_host, port=self.w.cfg.side_channel_port, rank=self.w.rank,
            block_ids=task.block_ids, block_size=layout.block_size, num_blocks=layout.num_blocks,
            first_token=task.first_token, num_tokens=task.num_tokens, prompt_hash=task.prompt_hash,
            tp_size=self.w.tp_size)
        reg.sig = struct_sig(reg)
        try:
            expect, d.p_ranks, idle = self._targets(task.host, task.port)
        except Exception as e:  # P unreachable or an impossible split: no WRITE can land
            expect, idle, failure = {self.w.rank}, [], e
        else:
            failure = None
        self._apply(self.receiver.expect(task.transfer_id, task.req_id, expect, now))
        sent: list[int] = []
        try:
            if failure is not None:
                raise failure
            for p in d.p_ranks:
                _, peer = self.w.peer_at(task.host, task.port, rank=p)
                self.w.transport.notify(peer, messages.encode(reg))
                sent.append(p)
        except Exception as e:
            log.warning("request %s: push registration with %s:%d failed (%s); recomputing",
                        task.req_id, task.host, task.port, e)
            for p in set(d.p_ranks or [0]) - set(sent):
                self.w.drop_peer(task.host, task.port, rank=p)
            if not sent:  # P never saw us, so no WRITE can land
                self._apply(self.receiver.rejected(task.transfer_id, f"registration failed: {e}",
                                                   now))
            else:  # some P ranks may write: wait them out, and ask them not to
                d.p_ranks = sent
                self._apply(self.receiver.failed(task.transfer_id, f"registration failed: {e}",
                                                 now))
            return
        for p in idle:  # a replica nobody reads: its blocks may go now
            self._tell_rank(task.host, task.port, p, messages.Abort(task.transfer_id))
        timeline.mark(log, task.transfer_id, "registered")
        log.debug("push %s: registered %d blocks with %s:%d", task.transfer_id,
                  len(task.block_ids), task.host, task.port)

    def _targets(self, host: str, port: int) -> tuple[set[int], list[int], list[int]]:
        """(P ranks whose Wrote we wait for, P ranks we register with, P ranks we tell
        to free at once). Same TP size: our own rank for all. Otherwise each P rank
        hears from one D rank, the lowest it writes to (it writes to all of them: an
        engine's ranks share block ids), and replicas nobody reads from ``p % d_tp``."""
        w = self.w
        p_tp = w.peer_tp(host, port)
        if p_tp == w.tp_size:
            return {w.rank}, [w.rank], []
        if w.num_heads <= 0:
            raise ValueError(f"prefill TP {p_tp} != ours {w.tp_size} and the model's KV heads "
                             "are unknown")
        lead, idle = [], []
        for p in range(p_tp):
            r = readers(w.num_heads, p_tp, w.tp_size, p)
            if r and min(r) == w.rank:
                lead.append(p)
            elif not r and p % w.tp_size == w.rank:
                idle.append(p)
        return writers(w.num_heads, p_tp, w.tp_size, w.rank), lead, idle

    def _tell_rank(self, host: str, port: int, rank: int, msg: messages.Message) -> None:
        try:
            self.w.notify(self.w.peer_at(host, port, rank=rank)[1], msg)
        except Exception as e:
            log.debug("push: cannot reach P %s:%d rank %d: %s", host, port, rank, e)

    def _tell_p(self, d: _DReq, msg: messages.Message) -> None:
        """Every P rank we registered with (none: another of our ranks did)."""
        for p in d.p_ranks:
            self._tell_rank(d.host, d.port, p, msg)

    def _apply(self, actions: list) -> None:
        for a in actions:
            d = self._d.get(a.transfer_id)
            if isinstance(a, RecvReady):
                ok = True
                if d is not None:
                    timeline.mark(log, a.transfer_id, "kv_in")
                    d.ready = True
                    del self._d[a.transfer_id]
                    log.info("push %s: KV in, %.1f ms after registering", a.transfer_id,
                             (time.monotonic() - d.registered_at) * 1e3)
                    self.w.stats.event("push_received", a.transfer_id)
                    ok = self.w.stage_in(a.req_id, d.block_ids)  # host staging: mirror -> device
                self.w.report(recvd={a.req_id}, bad_blocks=() if ok else d.block_ids)
            elif isinstance(a, RecvFailed):
                log.warning("push %s (request %s): %s; recomputing once no WRITE can land",
                            a.transfer_id, a.req_id, a.reason)
                self.w.stats.event("push_failed", a.transfer_id, a.reason)
                self.w.stats.event("recomputes", a.req_id, "push failed")
                if d is not None and ("rejected" not in a.reason or len(d.p_ranks) > 1):
                    self._tell_p(d, messages.Abort(a.transfer_id))
            elif isinstance(a, ReleaseDest):
                self._d.pop(a.transfer_id, None)
                self.w.report(recvd={a.req_id}, bad_blocks=d.block_ids if d else ())

    # -- P --------------------------------------------------------------------------------
    def _run(self, actions: list) -> None:
        now = time.monotonic()
        for a in actions:
            p = self._p.get(a.transfer_id)
            if isinstance(a, StartWrite):
                self._start_write(a, p, now)
            elif isinstance(a, FreeBlocks):
                if a.owner in self._unfinished:
                    self._deferred.add(a.owner)  # reported when the scheduler finishes it
                elif a.owner:
                    self.w.report(sent={a.owner})
                if p is not None and p.req_id != a.owner:
                    log.warning("push %s: request %s refused (%s)", a.transfer_id, a.owner,
                                a.reason)
            elif isinstance(a, Reject):
                log.info("push %s: rejecting D's registration: %s", a.transfer_id, a.reason)
                self.w.stats.event("rejections", a.transfer_id, a.reason)
                reg = p.reg if p is not None else None
                if reg is not None:
                    self._notify_d(reg, messages.Rejected(a.transfer_id, a.reason, self.w.rank))
        for tid in {a.transfer_id for a in actions}:
            self._forget_if_ended(tid)

    def _forget_if_ended(self, tid: str) -> None:
        """P-side state lives exactly as long as the matcher tracks the transfer."""
        if not self.matcher.is_live(tid):
            self._p.pop(tid, None)

    def _d_ranks(self, reg: messages.Register) -> list[int]:
        """D ranks this P rank writes for ``reg``: the registering rank when the TP sizes
        match, else every D rank taking some of our heads (tp_map.readers)."""
        if reg.tp_size == self.w.tp_size:
            return [reg.rank]
        if self.w.num_heads <= 0:
            raise ValueError(f"decode TP {reg.tp_size} != ours {self.w.tp_size} and the "
                             "model's KV heads are unknown")
        return sorted(readers(self.w.num_heads, self.w.tp_size, reg.tp_size, self.w.rank))

    def _notify_d(self, reg: messages.Register, msg: messages.Message) -> None:
        try:
            ranks = self._d_ranks(reg)
        except ValueError:
            ranks = [reg.rank]
        for d in ranks:
            try:
                self.w.notify(self.w.peer_at(reg.host, reg.port, reg.engine_id, d)[1], msg)
            except Exception as e:
                log.debug("push: cannot reach D %s rank %d: %s", reg.engine_id, d, e)

    def _start_write(self, a: StartWrite, p: _PReq | None, now: float) -> None:
        reg = p.reg if p is not None else None
        try:
            if reg is None:
                raise RuntimeError("registration vanished")
            if reg.prompt_hash != p.prompt_hash:
                raise ValueError("D registered a different prompt")
            targets = self._d_ranks(reg)
            self.w.stage_out(a.src_block_ids)  # host staging: the WRITE reads our mirror
            note = messages.encode(messages.Wrote(a.transfer_id, self.w.rank))
            xfers: list[Transfer] = []
            try:
                for d in targets:  # one WRITE per D rank, its notification after its data
                    _, peer = self.w.peer_at(reg.host, reg.port, reg.engine_id, d)
                    seg = None if reg.tp_size == self.w.tp_size else (
                        [s for s in plan(self.w.num_heads, self.w.tp_size, reg.tp_size, d)
                         if s.p_rank == self.w.rank], True)
                    xfers.append(self.w.transport.start("WRITE", peer, a.src_block_ids,
                                                        a.dest_block_ids[0], note, seg=seg))
            except Exception:
                for x in xfers:  # aborted by NIXL on release; nothing was reported to D
                    self.w.transport.release(x)
                raise
        except Exception as e:
            log.warning("push %s: WRITE not started: %s", a.transfer_id, e)
            self.w.stats.event("writes_failed", a.transfer_id, f"not started: {e}")
            self._run(self.matcher.write_failed(a.transfer_id, str(e), now))
            return
        started = time.monotonic()
        timeline.mark(log, a.transfer_id, "write_start")
        self._writes[a.transfer_id] = _Write(xfers, started + self.w.cfg.recv_timeout_s, started,
                                             p.ended_at)

    def on_message(self, msg: messages.Message, now: float) -> None:
        if isinstance(msg, messages.Register):
            if not struct_sig_ok(msg, msg.sig):
                log.warning("push %s: ignoring an unsigned or forged registration", msg.transfer_id)
                self.w.stats.event("registrations_forged", msg.transfer_id)
                return
            log.info("push %s: registration from %s (%d blocks from token %d)", msg.transfer_id,
                     msg.engine_id, len(msg.block_ids), msg.first_token)
            self.w.stats.event("registrations", msg.transfer_id, msg.engine_id)
            p = self._p.setdefault(msg.transfer_id, _PReq())
            p.reg = msg
            if p.req_id and p.prompt_hash != msg.prompt_hash:
                self._run(self.matcher.abort(msg.transfer_id, now))
            dest = Destination(msg.engine_id, "", (tuple(msg.block_ids),), msg.block_size,
                               msg.num_blocks, first_token=msg.first_token)
            if msg.block_size != self.matcher.block_size:
                self._notify_d(msg, messages.Rejected(msg.transfer_id, "block sizes differ",
                                                      self.w.rank))
                p.reg = None  # not served: P's own prefill of this id is freed at once
                self._run(self.matcher.abort(msg.transfer_id, now))
                self._forget_if_ended(msg.transfer_id)
                return
            self._run(self.matcher.registered(msg.transfer_id, msg.transfer_id, dest, now))
            self._forget_if_ended(msg.transfer_id)
        elif isinstance(msg, messages.Abort):
            self._run(self.matcher.abort(msg.transfer_id, now))
        elif isinstance(msg, messages.Wrote):
            self._apply(self.receiver.notified(msg.transfer_id, msg.rank))
        elif isinstance(msg, messages.Rejected):
            self._apply(self.receiver.rejected(msg.transfer_id, msg.reason, now,
                                               msg.rank if msg.rank >= 0 else None))

    # -- polling --------------------------------------------------------------------------
    def progress(self, now: float) -> None:
        if self._ready:
            self._release_ready(now)
        for tid, wr in list(self._writes.items()):
            state = self.w.transport.poll_all(wr.xfers)
            if state == "PROC" and now < wr.deadline:
                continue
            del self._writes[tid]
            if state == "DONE":
                timeline.mark(log, tid, "write_done")
                after = (time.time() - wr.ended_at) * 1e3 if wr.ended_at else float("nan")
                log.info("kvferry WRITE %s: %d B in %d descriptors, %.1f ms; done %.1f ms after "
                         "the prefill ended", tid, sum(x.nbytes for x in wr.xfers),
                         sum(x.ndesc for x in wr.xfers),
                         (time.monotonic() - wr.started) * 1e3, after)
                self.w.stats.event("writes_done", tid)
                self.w.stats.add("bytes_written", sum(x.nbytes for x in wr.xfers))
                self._run(self.matcher.write_done(tid, now))
            else:
                for x in wr.xfers:
                    self.w.transport.release(x)
                self.w.stats.event("writes_failed", tid, "timed out" if state == "PROC" else "error")
                self._run(self.matcher.write_failed(tid, "timed out" if state == "PROC" else "error",
                                                    now))
        if now - self._last_tick >= 0.05:
            self._last_tick = now
            self._run(self.matcher.tick(now))
            self._apply(self.receiver.tick(now))
