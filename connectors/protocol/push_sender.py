"""Push, P: what happens to each pushed prefill, as a pure state machine over `PushMatcher`.

The transfer thread (transfer/push_write.py) feeds in events (a step's metadata, a forward
reported or complete, D's registration or abort, a WRITE's outcome, time) and carries out
the `SendAction`s returned; nothing here does I/O, reads a clock or queries a device fence,
so every ordering can be tested (tests/test_push_sender.py).

Three ways a prefill reaches the matcher:
- whole-request push: P's scheduler finished the request (``push_send``);
- early push: the forward that computed the prompt's last tokens is complete on the device
  and a later engine step has begun, whose metadata would have named the request had vLLM
  preempted it (``forward`` then ``poll``). vLLM frees blocks only of finished requests, so
  a free decided before the scheduler finished the request is deferred until it does;
- layer-wise push (``layerwise``): handed over when its last chunk's step *begins*
  (``push_ready``), behind a `Gate`. A WRITE matched while the gate is closed is posted
  layer by layer (`Write.gate`, the strategy chosen once per request); D is told only once
  the gate opened (the same rule as early push). A preemption fails that WRITE.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.connectors.protocol import messages
from kvferry.connectors.protocol.push_match import (
    HOLD_TIMEOUT_S,
    REGISTER_TIMEOUT_S,
    Destination,
    FreeBlocks,
    PushAction,
    PushMatcher,
    Reject,
    StartWrite,
)
from kvferry.connectors.protocol.step import PushSend, StepMeta

TICK_S = 0.05  # time out held prefills and registrations at most this often


@dataclass
class Gate:
    """A push prompt whose last chunk engine step ``step`` computes, written layer by layer
    while that forward runs. Set here only; a layer-wise WRITE reads it."""

    item: PushSend
    step: int
    since: float  # a gate whose forward never reports is dropped after write_timeout
    reported: bool = False  # the forward's fence was handed over (wait_for_save)
    forward_done: bool = False  # ... and has passed: every layer is written
    opened: bool = False  # and a later step began without preempting the request


# -- actions: what the transfer thread carries out ---------------------------------------


@dataclass(frozen=True)
class Write:
    """Start the WRITE: whole at once, or (``gate`` set) layer by layer behind the gate."""

    start: StartWrite
    reg: messages.Register
    ended_at: float  # wall clock of the prefill's end (0: unknown), for the log
    gate: Gate | None = None


@dataclass(frozen=True)
class Free:
    """``owner``'s blocks are free: ``report`` them to vLLM now (else deferred until the
    scheduler finishes the request); ``refused``: why another request's were refused."""

    transfer_id: str
    owner: str
    report: bool
    refused: str = ""


@dataclass(frozen=True)
class RejectD:
    """Tell D (``reg``; None: not registered) its registration will not be served;
    ``counted``: a rejection of the matcher's (the block-size check is D's own error)."""

    transfer_id: str
    reason: str
    reg: messages.Register | None
    counted: bool = True


@dataclass(frozen=True)
class FailWrite:
    """End the WRITE unsuccessfully (release its transfers), then report `write_failed`.
    ``detail``: what to count, when it differs from ``reason`` (the matcher's)."""

    transfer_id: str
    reason: str
    detail: str = ""


@dataclass(frozen=True)
class Mark:
    """A point on the transfer's timeline (protocol/timeline.py)."""

    transfer_id: str
    what: str


SendAction = Write | Free | RejectD | FailWrite | Mark


@dataclass
class _PReq:
    """One prefilled request and, once registered, where its KV goes."""

    req_id: str = ""
    prompt_hash: str = ""
    reg: messages.Register | None = None
    ended_at: float = 0.0


@dataclass
class PushSender:
    """P side of push for one rank: prefills and registrations in, WRITEs and frees out."""

    block_size: int
    num_blocks: int | None = None
    hold_timeout: float = HOLD_TIMEOUT_S
    register_timeout: float = REGISTER_TIMEOUT_S
    write_timeout: float = 30.0  # recv_timeout_s: a gate whose forward never reports
    layerwise: bool = False
    matcher: PushMatcher = field(init=False)

    def __post_init__(self) -> None:
        self.matcher = PushMatcher(self.block_size, self.num_blocks,
                                   hold_timeout=self.hold_timeout,
                                   register_timeout=self.register_timeout)
        self._p: dict[str, _PReq] = {}
        self._ready: dict[str, tuple[PushSend, int]] = {}  # early push: req id -> (item, step)
        self._unfinished: set[str] = set()  # handed over before the scheduler finished them
        self._deferred: set[str] = set()  # ... and already freed by the matcher
        self._gates: dict[str, Gate] = {}  # layer-wise: req id -> gate of its last chunk
        self._layered: dict[str, Gate] = {}  # transfer id -> gate of a layer-wise WRITE
        # handed to the matcher early and not preempted since (a subset of _unfinished)
        self._handed: set[str] = set()
        self._last_tick = 0.0

    # -- inspection ------------------------------------------------------------------------
    def busy(self) -> bool:
        """A forward whose prompts may be written once it is done."""
        return bool(self._ready or self._gates)

    def awaiting(self) -> bool:
        """A registration is expected (or a transfer is under way)."""
        return bool(self._p)

    @property
    def num_tracked(self) -> int:
        return len(self._p) + len(self._ready) + len(self._deferred) + len(self._gates)

    @property
    def num_unfinished(self) -> int:
        return len(self._unfinished | self._handed)

    def forward_steps(self) -> set[int]:
        """Steps whose forward's fence is still awaited."""
        return ({step for _, step in self._ready.values()}
                | {g.step for g in self._gates.values() if g.reported})

    def gate_steps(self) -> set[int]:
        """Steps whose layer fences a closed gate may still post by."""
        return {g.step for g in self._gates.values()}

    def must_drain(self, steps: int, passed: set[int]) -> bool:
        """Something would be released by `poll`: first read every step's metadata queued so
        far (the next step's may say a request was preempted)."""
        return (any(steps > st and st in passed for _, st in self._ready.values())
                or any(g.reported and steps > g.step and g.step in passed
                       for g in self._gates.values()))

    # -- events ----------------------------------------------------------------------------
    def forward(self, items: list[PushSend], step: int) -> None:
        """Step ``step``'s forward computed the last tokens of ``items`` (fence handed over)."""
        for s in items:
            if (g := self._gates.get(s.req_id)) is not None and g.step == step:
                g.reported = True
            elif s.req_id not in self._handed:
                # (A request the matcher already has, e.g. a layer-wise one whose gate timed
                # out, is never handed over a second time: that freed its blocks twice.)
                self._ready[s.req_id] = (s, step)

    def step_meta(self, meta: StepMeta, step: int, now: float) -> list[SendAction]:
        """A step's metadata; ``step``: the engine step it belongs to."""
        out: list[SendAction] = []
        for tid, req_id in meta.push_preempted:
            # vLLM freed the blocks (the gates kept D from using any WRITE off them):
            # nothing to report freed; D is rejected and recomputes.
            self._ready.pop(req_id, None)
            self._gates.pop(req_id, None)
            self._handed.discard(req_id)
            if (g := self._layered.get(tid)) is not None and g.item.req_id == req_id:
                out.append(FailWrite(tid, "preempted on P"))
            else:
                out += self._run(self.matcher.abort(tid, now, owner=req_id), now)
        for s in meta.push_send:
            self._ready.pop(s.req_id, None)  # not yet released: the normal path now
            out += self._finished(s.req_id)
            out += self._prefill_done(s, now)  # a duplicate of an early push changes nothing
        for tid, req_id in meta.push_abort_p:
            if self._ready.pop(req_id, None) is not None:  # held for a WRITE never started
                out.append(Free(tid, req_id, report=True))
            out += self._finished(req_id)
            out += self._run(self.matcher.abort(tid, now, owner=req_id), now)
        if self.layerwise:
            for s in meta.push_ready:  # this step computes their last chunk
                self._gates[s.req_id] = Gate(s, step, now)
                self._unfinished.add(s.req_id)
                self._handed.add(s.req_id)
                out += self._prefill_done(s, now)
        return out

    def registered(self, msg: messages.Register, now: float) -> list[SendAction]:
        """D's (authenticated) registration."""
        tid = msg.transfer_id
        p = self._p.setdefault(tid, _PReq())
        p.reg = msg
        out: list[SendAction] = []
        if p.req_id and p.prompt_hash != msg.prompt_hash:
            out += self._run(self.matcher.abort(tid, now), now)
            self._p.setdefault(tid, p)  # ended, but D must still be told (below)
        if msg.block_size != self.matcher.block_size:
            out.append(RejectD(tid, "block sizes differ", msg, counted=False))
            p.reg = None  # not served: P's own prefill of this id is freed at once
            out += self._run(self.matcher.abort(tid, now), now)
        else:
            dest = Destination((tuple(msg.block_ids),), msg.block_size, msg.num_blocks,
                               first_token=msg.first_token)
            out += self._run(self.matcher.registered(tid, dest, now), now)
        self._forget_if_ended(tid)
        return out

    def aborted(self, transfer_id: str, now: float) -> list[SendAction]:
        """D gave up on the transfer."""
        return self._run(self.matcher.abort(transfer_id, now), now)

    def poll(self, steps: int, passed: set[int], now: float) -> list[SendAction]:
        """``steps`` engine steps have begun; the forwards of steps ``passed`` are complete.
        Hand the matcher every early prompt whose forward is done and a later step began;
        open those gates (a gate never reported is dropped after write_timeout: its WRITE,
        if any, times out too)."""
        out: list[SendAction] = []
        for req_id, (s, st) in list(self._ready.items()):
            if steps > st and st in passed:
                del self._ready[req_id]
                out.append(Mark(s.transfer_id, "forward_done"))
                self._unfinished.add(req_id)
                self._handed.add(req_id)
                out += self._prefill_done(s, now)
        for req_id, g in list(self._gates.items()):
            g.forward_done = g.forward_done or (g.reported and g.step in passed)
            if g.forward_done and steps > g.step:
                del self._gates[req_id]
                g.opened = True
                out.append(Mark(g.item.transfer_id, "forward_done"))
            elif now - g.since >= self.write_timeout:
                del self._gates[req_id]
        return out

    def tick(self, now: float) -> list[SendAction]:
        """Time out held prefills and waiting registrations (at most every TICK_S)."""
        if now - self._last_tick < TICK_S:
            return []
        self._last_tick = now
        return self._run(self.matcher.tick(now), now)

    def write_done(self, transfer_id: str, now: float) -> list[SendAction]:
        """Every transfer of the WRITE completed (and D was told)."""
        self._layered.pop(transfer_id, None)
        return self._run(self.matcher.write_done(transfer_id, now), now)

    def write_failed(self, transfer_id: str, reason: str, now: float) -> list[SendAction]:
        """The WRITE ended unsuccessfully; none of its transfers can still land."""
        self._layered.pop(transfer_id, None)
        return self._run(self.matcher.write_failed(transfer_id, reason, now), now)

    # -- internals -------------------------------------------------------------------------
    def _prefill_done(self, s: PushSend, now: float) -> list[SendAction]:
        p = self._p.setdefault(s.transfer_id, _PReq())
        out: list[SendAction] = []
        if not p.req_id:  # else another request holds this id: the matcher refuses us
            p.req_id, p.prompt_hash, p.ended_at = s.req_id, s.prompt_hash, s.ended_at
            if p.reg is not None and p.reg.prompt_hash != s.prompt_hash:  # another prompt
                out += self._run(self.matcher.abort(s.transfer_id, now), now)
        out += self._run(self.matcher.prefill_done(s.transfer_id, s.block_ids, s.num_tokens,
                                                   now, owner=s.req_id), now)
        # A duplicate (the scheduler's push_send after an early push wrote) decides
        # nothing: drop the entry it re-created, or it would linger forever.
        self._forget_if_ended(s.transfer_id)
        return out

    def _finished(self, owner: str) -> list[SendAction]:
        """P's scheduler finished ``owner``: a free the matcher already decided is due."""
        self._unfinished.discard(owner)
        self._handed.discard(owner)
        if owner not in self._deferred:
            return []
        self._deferred.discard(owner)
        return [Free("", owner, report=True)]

    def _run(self, actions: list[PushAction], now: float) -> list[SendAction]:
        """The matcher's decisions, as the transfer thread's actions."""
        out: list[SendAction] = []
        for a in actions:
            p = self._p.get(a.transfer_id)
            if isinstance(a, StartWrite):
                out += self._write(a, p, now)
            elif isinstance(a, FreeBlocks):
                if a.owner in self._unfinished:
                    self._deferred.add(a.owner)  # reported when the scheduler finishes it
                refused = a.reason if p is not None and p.req_id != a.owner else ""
                report = bool(a.owner) and a.owner not in self._unfinished
                if report or refused:
                    out.append(Free(a.transfer_id, a.owner, report, refused))
            elif isinstance(a, Reject):
                out.append(RejectD(a.transfer_id, a.reason, p.reg if p is not None else None))
        for tid in {a.transfer_id for a in actions}:
            self._forget_if_ended(tid)
        return out

    def _write(self, a: StartWrite, p: _PReq | None, now: float) -> list[SendAction]:
        reg = p.reg if p is not None else None
        why = ("registration vanished" if p is None or reg is None
               else "D registered a different prompt" if reg.prompt_hash != p.prompt_hash
               else "")
        if why or p is None or reg is None:
            return [FailWrite(a.transfer_id, why, f"not started: {why}")]
        gate = self._gates.get(a.owner)  # the forward is still running: layer by layer
        if gate is not None:
            self._layered[a.transfer_id] = gate
        return [Write(a, reg, p.ended_at, gate)]

    def _forget_if_ended(self, tid: str) -> None:
        """P-side state lives exactly as long as the matcher tracks the transfer."""
        if not self.matcher.is_live(tid):
            self._p.pop(tid, None)
