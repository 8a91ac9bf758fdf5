"""Push, P, on the transfer thread: pair D's registration with the finished prefill, WRITE.

`PushMatcher` pairs registrations with finished prefills (either order); the later event
starts the WRITE here, on this thread, never on the engine loop. Every outcome reaches
vLLM as a finished send (P frees its blocks), and D hears a `Rejected` whenever its
registration will not be served.

Early push: a prompt's WRITE may start once the forward that computed its last tokens
is complete on the device (`Ready`: a fence, and a later engine step begun, whose
metadata would have said the request was preempted). Layer-wise push (layer_push.py):
the prefill is handed to the matcher when its last chunk's step begins, and a WRITE
matched before that step's `Gate` opens is posted layer by layer as the forward goes,
D told once every layer is complete and the gate opened.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvferry.connectors.config import ConnectorConfig
from kvferry.connectors.protocol import messages, timeline
from kvferry.connectors.protocol.params import mac_ok
from kvferry.connectors.protocol.push_match import (
    Destination,
    FreeBlocks,
    PushAction,
    PushMatcher,
    Reject,
    StartWrite,
)
from kvferry.connectors.protocol.step import PushSend, StepMeta
from kvferry.connectors.transfer.layer_push import Fences, Gate, LayeredWrite, LayerFence, Ready
from kvferry.connectors.transfer.rank_io import RankIO, RankPart
from kvferry.connectors.transfer.transport import Transfer, XferState

log = logging.getLogger("vllm." + __name__)

TICK_S = 0.05  # time out held prefills and registrations at most this often


@dataclass
class _PReq:
    """P: one prefilled request and, once registered, where its KV goes."""

    req_id: str = ""
    prompt_hash: str = ""
    reg: messages.Register | None = None
    ended_at: float = 0.0  # wall clock when P's scheduler saw the prefill end


@dataclass
class _Write:
    xfers: list[Transfer]  # one per D rank written (several when D's TP size is smaller)
    deadline: float
    started: float
    ended_at: float  # wall clock of the prefill's end (0: unknown)
    layered: LayeredWrite | None = None  # posted layer by layer, D told on commit


class PushWrite(RankPart):
    def __init__(self, cfg: ConnectorConfig, io: RankIO, steps: Callable[[], int],
                 drain: Callable[[], None]) -> None:
        """``steps``: engine steps begun so far; ``drain``: act on every step's metadata
        queued so far (an early push must see whether the next step preempted it)."""
        super().__init__(io)
        self.recv_timeout_s = cfg.recv_timeout_s
        self._steps = steps
        self._drain = drain
        layout = self.transport.layout
        self.matcher = PushMatcher(layout.block_size, layout.num_blocks,
                                   hold_timeout=cfg.push_hold_timeout_s,
                                   register_timeout=cfg.push_register_timeout_s)
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
        # Layer-wise push: prompts whose last chunk is being computed (request id -> gate)
        # and the layer fences of those steps. Needs the layout's planes per layer, and
        # UCX, whose transfers complete only once flushed to the target (the Wrote
        # notification goes out after them, on its own).
        self.layerwise = (cfg.layerwise_push and len(layout.layers) > 1
                          and set(self.transport.backends) == {"UCX"})
        self._gates: dict[str, Gate] = {}
        self._fences = Fences()

    def busy(self) -> bool:
        """A WRITE in flight, or a forward whose prompts may be written once it is done."""
        return bool(self._writes or self._ready or self._gates)

    def awaiting(self) -> bool:
        """A registration is expected (or a transfer is under way)."""
        return bool(self._p)

    @property
    def num_tracked(self) -> int:
        """Transfers this rank holds any state for (0: nothing left behind)."""
        return (len(self._p) + len(self._writes) + len(self._ready) + len(self._deferred)
                + len(self._gates) + len(self._fences))

    @property
    def num_unfinished(self) -> int:
        """Early-pushed prefills the scheduler has not finished yet."""
        return len(self._unfinished)

    def ready(self, r: Ready) -> None:
        for s in r.items:
            if (g := self._gates.get(s.req_id)) is not None and g.step == r.step:
                g.ready = r  # layer-wise: the gate opens once this forward is done
            else:
                self._ready[s.req_id] = (s, r)

    def layer_fence(self, f: LayerFence) -> None:
        """Layer-wise push: a layer of step ``f.step`` is written once ``f.fence`` passes."""
        if any(g.step == f.step for g in self._gates.values()):
            self._fences.add(f)
            self.stats.add("layer_fences")

    def _release_ready(self, now: float) -> None:
        """Early push: hand the matcher every prompt whose forward is complete."""
        steps = self._steps()
        if not any(r.done(steps) for _, r in self._ready.values()):
            return
        self._drain()  # the next step's meta may say a request was preempted
        for req_id, (s, r) in list(self._ready.items()):
            if r.done(steps):
                del self._ready[req_id]
                timeline.mark(log, s.transfer_id, "forward_done")
                self._unfinished.add(req_id)
                self._prefill_done(s, now)

    def _open_gates(self, now: float) -> None:
        """Layer-wise push: open the gates whose forward is done and a later step began,
        once the metadata queued so far was read (a preemption there closes the gate for
        good: `accept`). A gate whose forward never reported (an engine that failed
        mid-step) is dropped after recv_timeout_s; its WRITE, if any, times out then too."""
        steps = self._steps()
        if any(g.may_open(steps) for g in self._gates.values()):
            self._drain()
        for req_id, g in list(self._gates.items()):
            if g.may_open(steps):
                del self._gates[req_id]
                g.opened = True
                timeline.mark(log, g.item.transfer_id, "forward_done")
            elif now - g.since >= self.recv_timeout_s:
                del self._gates[req_id]

    def _forget_fences(self) -> None:
        """Keep the layer fences of steps a gate or an unposted layer still needs."""
        self._fences.keep_only({g.step for g in self._gates.values()}
                               | {w.layered.gate.step for w in self._writes.values()
                                  if w.layered is not None and w.layered.pending})

    # -- from the engine's step metadata -------------------------------------------------
    def accept(self, meta: StepMeta, now: float, step: int = 0) -> None:
        """A step's metadata; ``step``: the engine step it belongs to (layer-wise push
        pairs the prompts it completes with that step's layer fences)."""
        for tid, req_id in meta.push_preempted:
            # vLLM freed the blocks (the gates kept D from using any WRITE off them):
            # nothing to report freed; D is rejected and recomputes.
            self._ready.pop(req_id, None)
            self._gates.pop(req_id, None)
            wr = self._writes.get(tid)
            if wr is not None and wr.layered is not None and wr.layered.gate.item.req_id == req_id:
                self._fail_write(tid, wr, "preempted on P", now)
            else:
                self._run(self.matcher.abort(tid, now, owner=req_id))
        for s in meta.push_send:
            self._ready.pop(s.req_id, None)  # not yet released: the normal path now
            self._finished(s.req_id)
            self._prefill_done(s, now)  # a duplicate of an early push changes nothing
        for tid, req_id in meta.push_abort_p:
            if self._ready.pop(req_id, None) is not None:
                self.out.report(sent={req_id})  # held for a WRITE that never started
            self._finished(req_id)
            self._run(self.matcher.abort(tid, now, owner=req_id))
        if self.layerwise:
            for s in meta.push_ready:  # this step computes their last chunk
                self._gates[s.req_id] = Gate(s, step, now)
                self._unfinished.add(s.req_id)
                self._prefill_done(s, now)

    def _prefill_done(self, s: PushSend, now: float) -> None:
        p = self._p.setdefault(s.transfer_id, _PReq())
        if not p.req_id:  # else another request holds this id: the matcher refuses us
            p.req_id, p.prompt_hash, p.ended_at = s.req_id, s.prompt_hash, s.ended_at
            if p.reg is not None and p.reg.prompt_hash != s.prompt_hash:
                self._run(self.matcher.abort(s.transfer_id, now))  # D registered another prompt
        self._run(self.matcher.prefill_done(s.transfer_id, s.block_ids, s.num_tokens, now,
                                            owner=s.req_id))
        # A duplicate (the scheduler's push_send after an early push wrote) decides
        # nothing: drop the entry it re-created, or it would linger (and keep the thread
        # polling for a registration) forever.
        self._forget_if_ended(s.transfer_id)

    def _finished(self, owner: str) -> None:
        """P's scheduler finished ``owner``: a free the matcher already decided is due."""
        self._unfinished.discard(owner)
        if owner in self._deferred:
            self._deferred.discard(owner)
            self.out.report(sent={owner})

    # -- the matcher's decisions ------------------------------------------------------------
    def _run(self, actions: list[PushAction]) -> None:
        now = time.monotonic()
        for a in actions:
            p = self._p.get(a.transfer_id)
            if isinstance(a, StartWrite):
                self._start_write(a, p, now)
            elif isinstance(a, FreeBlocks):
                if a.owner in self._unfinished:
                    self._deferred.add(a.owner)  # reported when the scheduler finishes it
                elif a.owner:
                    self.out.report(sent={a.owner})
                if p is not None and p.req_id != a.owner:
                    log.warning("push %s: request %s refused (%s)", a.transfer_id, a.owner,
                                a.reason)
            elif isinstance(a, Reject):
                log.info("push %s: rejecting D's registration: %s", a.transfer_id, a.reason)
                self.stats.event("rejections", a.transfer_id, a.reason)
                reg = p.reg if p is not None else None
                if reg is not None:
                    self._notify_d(reg, messages.Rejected(a.transfer_id, a.reason, self.ranks.rank))
        for tid in {a.transfer_id for a in actions}:
            self._forget_if_ended(tid)

    def _forget_if_ended(self, tid: str) -> None:
        """P-side state lives exactly as long as the matcher tracks the transfer."""
        if not self.matcher.is_live(tid):
            self._p.pop(tid, None)

    def _notify_d(self, reg: messages.Register, msg: messages.Message) -> None:
        try:
            ranks = self.ranks.write_ranks(reg.tp_size, reg.rank)
        except ValueError:
            ranks = [reg.rank]
        for d in ranks:
            self.peers.tell_rank(reg.host, reg.port, d, msg, reg.engine_id)

    def _start_write(self, a: StartWrite, p: _PReq | None, now: float) -> None:
        reg = p.reg if p is not None else None
        try:
            if reg is None:
                raise RuntimeError("registration vanished")
            if reg.prompt_hash != p.prompt_hash:
                raise ValueError("D registered a different prompt")
            # (peer, head segments) of every D rank we write: one WRITE each
            dests = [(self.peers.at(reg.host, reg.port, reg.engine_id, d)[1],
                      self.ranks.write_segments(reg.tp_size, d))
                     for d in self.ranks.write_ranks(reg.tp_size, reg.rank)]
            self.mirror.stage_out(a.src_block_ids)  # host staging: the WRITE reads our mirror
            note = messages.encode(messages.Wrote(a.transfer_id, self.ranks.rank))
            xfers: list[Transfer] = []
            layered = None
            if (g := self._gates.get(a.owner)) is not None:  # the forward is still running:
                layered = LayeredWrite(g, dests, a.src_block_ids, a.dest_block_ids[0], note,
                                       pending=list(range(len(self.transport.layout.layers))))
            else:
                try:
                    for peer, segs in dests:  # its notification after its data
                        xfers.append(self.transport.start(
                            "WRITE", peer, a.src_block_ids, a.dest_block_ids[0], note,
                            seg=None if segs is None else (segs, True)))
                except Exception:
                    for x in xfers:  # aborted by NIXL on release; nothing was reported to D
                        self.transport.release(x)
                    raise
        except Exception as e:
            log.warning("push %s: WRITE not started: %s", a.transfer_id, e)
            self.stats.event("writes_failed", a.transfer_id, f"not started: {e}")
            self._run(self.matcher.write_failed(a.transfer_id, str(e), now))
            return
        started = time.monotonic()
        timeline.mark(log, a.transfer_id, "write_start")
        self._writes[a.transfer_id] = _Write(xfers, started + self.recv_timeout_s, started,
                                             p.ended_at, layered)

    # -- from D ---------------------------------------------------------------------------
    def on_message(self, msg: messages.Register | messages.Abort, now: float) -> None:
        if isinstance(msg, messages.Abort):
            self._run(self.matcher.abort(msg.transfer_id, now))
            return
        if not mac_ok(msg, msg.sig):
            log.warning("push %s: ignoring an unsigned or forged registration", msg.transfer_id)
            self.stats.event("registrations_forged", msg.transfer_id)
            return
        self.stats.event("registrations", msg.transfer_id, msg.engine_id)
        log.info("push %s: registration from %s (%d blocks from token %d)", msg.transfer_id,
                 msg.engine_id, len(msg.block_ids), msg.first_token)
        p = self._p.setdefault(msg.transfer_id, _PReq())
        p.reg = msg
        if p.req_id and p.prompt_hash != msg.prompt_hash:
            self._run(self.matcher.abort(msg.transfer_id, now))
        dest = Destination((tuple(msg.block_ids),), msg.block_size, msg.num_blocks,
                           first_token=msg.first_token)
        if msg.block_size != self.matcher.block_size:
            self._notify_d(msg, messages.Rejected(msg.transfer_id, "block sizes differ",
                                                  self.ranks.rank))
            p.reg = None  # not served: P's own prefill of this id is freed at once
            self._run(self.matcher.abort(msg.transfer_id, now))
            self._forget_if_ended(msg.transfer_id)
            return
        self._run(self.matcher.registered(msg.transfer_id, dest, now))
        self._forget_if_ended(msg.transfer_id)

    # -- polling --------------------------------------------------------------------------
    def _fail_write(self, tid: str, wr: _Write, why: str, now: float) -> None:
        """End a WRITE that did not complete: NIXL aborts what is in flight on release; the
        matcher frees P's blocks (or defers it to the request's end) and rejects D."""
        self._writes.pop(tid, None)
        for x in wr.xfers:
            self.transport.release(x)
        self.stats.event("writes_failed", tid, why)
        self._run(self.matcher.write_failed(tid, why, now))

    def _post_layers(self, tid: str, wr: _Write, now: float) -> bool:
        """Layer-wise: post the layers written by now. False if a post failed (the WRITE
        is failed)."""
        assert wr.layered is not None
        try:
            wr.xfers += wr.layered.post(self.transport, self._fences)
        except Exception as e:
            log.warning("push %s: layer WRITE not posted: %s", tid, e)
            self._fail_write(tid, wr, f"not posted: {e}", now)
            return False
        return True

    def progress(self, now: float) -> None:
        if self._ready:
            self._release_ready(now)
        if self._gates:
            self._open_gates(now)
        for tid, wr in list(self._writes.items()):
            if tid not in self._writes:  # failed by a preemption read while opening gates
                continue
            if wr.layered is not None:
                if not self._post_layers(tid, wr, now):
                    continue
                if not wr.layered.committable():  # layers to post, or the gate closed
                    if now >= wr.deadline:
                        self._fail_write(tid, wr, "timed out", now)
                    continue
            state = self.transport.poll_all(wr.xfers)
            if state == XferState.PROC and now < wr.deadline:
                continue
            del self._writes[tid]
            if state == XferState.DONE and wr.layered is not None:
                wr.layered.commit(self.transport)  # every layer landed: tell D
                self.stats.add("layered_writes")
                self.stats.add("layers_posted_early", wr.layered.posted_early)
                self.stats.add("layer_batches", wr.layered.batches)
            if state == XferState.DONE:
                timeline.mark(log, tid, "write_done")
                after = (time.time() - wr.ended_at) * 1e3 if wr.ended_at else float("nan")
                log.info("kvferry WRITE %s: %d B in %d descriptors, %.1f ms; done %.1f ms after "
                         "the prefill ended", tid, sum(x.nbytes for x in wr.xfers),
                         sum(x.ndesc for x in wr.xfers),
                         (time.monotonic() - wr.started) * 1e3, after)
                self.stats.event("writes_done", tid)
                self.stats.add("bytes_written", sum(x.nbytes for x in wr.xfers))
                self._run(self.matcher.write_done(tid, now))
            else:
                self._fail_write(tid, wr, "timed out" if state == XferState.PROC else "error", now)
        if len(self._fences):
            self._forget_fences()
        if now - self._last_tick >= TICK_S:
            self._last_tick = now
            self._run(self.matcher.tick(now))
