"""P's push state machine (connectors/protocol/push_sender.py): events in, actions out.

Examples of each path (whole-request, early and layer-wise push, preemption, D's errors),
then a hypothesis state machine that interleaves every event over several requests and
checks the block, WRITE and rejection invariants the transfer thread relies on."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvferry.connectors.protocol import messages
from kvferry.connectors.protocol.push_sender import (
    TICK_S,
    FailWrite,
    Free,
    Mark,
    PushSender,
    RejectD,
    Write,
)
from kvferry.connectors.protocol.step import PushSend, StepMeta

BS = 16
WRITE_TIMEOUT = 5.0


def sender(layerwise: bool = False) -> PushSender:
    return PushSender(BS, 100, hold_timeout=3.0, register_timeout=4.0,
                      write_timeout=WRITE_TIMEOUT, layerwise=layerwise)


def item(owner: str = "p1", tid: str = "t1", prompt: str = "h") -> PushSend:
    return PushSend(owner, tid, [5, 6, 7], 40, prompt)


def reg(tid: str = "t1", prompt: str = "h", block_size: int = BS) -> messages.Register:
    return messages.Register(tid, "D", "127.0.0.1", 1, 0, [10, 11, 12], block_size, 100, 0,
                             40, prompt)


def reports(actions) -> list[str]:
    return [a.owner for a in actions if isinstance(a, Free) and a.report]


def writes(actions) -> list[Write]:
    return [a for a in actions if isinstance(a, Write)]


# -- examples -------------------------------------------------------------------------------


def test_whole_request_push_writes_once_then_frees() -> None:
    s = sender()
    assert s.step_meta(StepMeta(push_send=[item()]), 1, 0.0) == []
    assert s.awaiting() and not s.busy()
    [w] = writes(s.registered(reg(), 0.1))
    assert w.gate is None and w.start.owner == "p1" and w.reg.transfer_id == "t1"
    assert w.start.src_block_ids == (5, 6, 7) and w.start.dest_block_ids == ((10, 11, 12),)
    assert s.registered(reg(), 0.2) == []  # duplicate: the first one stands
    assert reports(s.write_done("t1", 0.3)) == ["p1"]
    assert s.num_tracked == 0 and not s.awaiting() and s.matcher.num_live == 0


def test_early_push_waits_for_the_fence_and_a_later_step_and_defers_the_free() -> None:
    s = sender()
    s.registered(reg(), 0.0)
    s.forward([item()], 1)
    assert s.busy() and s.forward_steps() == {1}
    assert not s.must_drain(1, {1}) and s.poll(1, {1}, 0.1) == []  # no later step yet
    assert not s.must_drain(2, set()) and s.poll(2, set(), 0.1) == []  # fence not passed
    assert s.must_drain(2, {1})
    out = s.poll(2, {1}, 0.2)
    assert out[0] == Mark("t1", "forward_done") and len(writes(out)) == 1
    assert s.num_unfinished == 1 and s.forward_steps() == set()
    # Written before P's scheduler finished the request: vLLM may not free it yet.
    assert reports(s.write_done("t1", 0.3)) == []
    assert reports(s.step_meta(StepMeta(push_send=[item()]), 3, 0.4)) == ["p1"]
    assert s.num_tracked == 0 and s.num_unfinished == 0


def test_a_preempted_early_push_is_never_written() -> None:
    s = sender()
    s.registered(reg(), 0.0)
    s.forward([item()], 1)
    out = s.step_meta(StepMeta(push_preempted=[("t1", "p1")]), 2, 0.1)
    assert out == [RejectD("t1", "aborted on P", reg())]  # D recomputes
    assert s.poll(2, {1}, 0.2) == [] and not s.busy()
    # Resumed and finished later: freed once, never written.
    assert s.step_meta(StepMeta(push_send=[item()]), 5, 0.3) == [
        Free("t1", "p1", report=True)]
    assert s.num_tracked == 0


def test_a_cancelled_early_push_is_freed_at_once() -> None:
    s = sender()
    s.forward([item()], 1)
    out = s.step_meta(StepMeta(push_abort_p=[("t1", "p1")]), 2, 0.1)
    assert reports(out) == ["p1"] and s.num_tracked == 0
    assert s.registered(reg(), 0.2) == [RejectD("t1", "transfer aborted", reg())]


def test_layerwise_writes_behind_a_gate_that_opens_after_the_forward() -> None:
    s = sender(layerwise=True)
    s.registered(reg(), 0.0)
    [w] = writes(s.step_meta(StepMeta(push_ready=[item()]), 1, 0.1))
    g = w.gate
    assert g is not None and g.step == 1 and not (g.reported or g.forward_done or g.opened)
    assert s.gate_steps() == {1} and s.forward_steps() == set()
    s.forward([item()], 1)
    assert g.reported and s.forward_steps() == {1}
    assert s.poll(1, {1}, 0.2) == [] and g.forward_done and not g.opened  # no later step
    assert s.poll(2, {1}, 0.3) == [Mark("t1", "forward_done")] and g.opened
    assert s.gate_steps() == set()
    assert reports(s.write_done("t1", 0.4)) == []  # the scheduler has not finished it
    assert reports(s.step_meta(StepMeta(push_send=[item()]), 3, 0.5)) == ["p1"]
    assert s.num_tracked == 0


def test_layerwise_off_ignores_push_ready() -> None:
    s = sender(layerwise=False)
    assert s.step_meta(StepMeta(push_ready=[item()]), 1, 0.0) == [] and s.num_tracked == 0


def test_registration_after_the_gate_opened_is_a_whole_write() -> None:
    s = sender(layerwise=True)
    s.step_meta(StepMeta(push_ready=[item()]), 1, 0.0)
    s.forward([item()], 1)
    s.poll(2, {1}, 0.1)
    [w] = writes(s.registered(reg(), 0.2))
    assert w.gate is None


def test_preemption_fails_a_layerwise_write_and_rejects_d() -> None:
    s = sender(layerwise=True)
    s.registered(reg(), 0.0)
    s.step_meta(StepMeta(push_ready=[item()]), 1, 0.1)
    out = s.step_meta(StepMeta(push_preempted=[("t1", "p1")]), 2, 0.2)
    assert out == [FailWrite("t1", "preempted on P")]
    out = s.write_failed("t1", "preempted on P", 0.3)
    assert [a for a in out if isinstance(a, RejectD)] == [
        RejectD("t1", "write failed: preempted on P", reg())]
    assert reports(out) == []  # vLLM freed them; reported once the request ends
    assert reports(s.step_meta(StepMeta(push_send=[item()]), 4, 0.4)) == ["p1"]
    assert s.num_tracked == 0 and s.num_unfinished == 0


def test_a_gate_whose_forward_never_reports_is_dropped_in_time() -> None:
    s = sender(layerwise=True)
    s.step_meta(StepMeta(push_ready=[item()]), 1, 0.0)
    assert s.poll(3, set(), WRITE_TIMEOUT - 0.1) == [] and s.busy()
    assert s.poll(3, set(), WRITE_TIMEOUT) == [] and not s.busy()


def test_other_block_size_is_rejected_uncounted_and_frees_the_prefill() -> None:
    s = sender()
    s.step_meta(StepMeta(push_send=[item()]), 1, 0.0)
    out = s.registered(reg(block_size=BS * 2), 0.1)
    assert RejectD("t1", "block sizes differ", reg(block_size=BS * 2), counted=False) in out
    assert reports(out) == ["p1"] and not writes(out) and s.num_tracked == 0


def test_another_prompt_is_never_written_and_d_is_told() -> None:
    """(Before the state machine, D was not told here: P forgot the registration while
    aborting and waited for D's own timeout.)"""
    s = sender()
    s.step_meta(StepMeta(push_send=[item(prompt="mine")]), 1, 0.0)
    out = s.registered(reg(prompt="theirs"), 0.1)
    assert not writes(out) and reports(out) == ["p1"]
    assert [a.reg for a in out if isinstance(a, RejectD)] == [reg(prompt="theirs")]


def test_a_second_request_with_a_transfer_id_in_use_is_refused() -> None:
    s = sender()
    s.step_meta(StepMeta(push_send=[item()]), 1, 0.0)
    out = s.step_meta(StepMeta(push_send=[item(owner="p2")]), 2, 0.1)
    assert [(a.owner, a.report, bool(a.refused)) for a in out] == [("p2", True, True)]
    [w] = writes(s.registered(reg(), 0.2))
    assert w.start.owner == "p1"


def test_held_prefills_time_out_on_tick() -> None:
    s = sender()
    s.step_meta(StepMeta(push_send=[item()]), 1, 0.0)
    assert s.tick(1.0) == []
    assert s.tick(1.0 + TICK_S / 2) == []  # at most every TICK_S
    assert reports(s.tick(3.5)) == ["p1"] and s.num_tracked == 0


def test_d_abort_frees_a_held_prefill() -> None:
    s = sender()
    s.step_meta(StepMeta(push_send=[item()]), 1, 0.0)
    assert reports(s.aborted("t1", 0.1)) == ["p1"] and s.num_tracked == 0


def test_a_request_handed_over_is_never_handed_over_again() -> None:
    """Found by the model: a second fence for a prompt the matcher already refused (its
    transfer id was in use) put it back on the early list, and P's abort then freed its
    blocks twice. Likewise a layer-wise prompt whose gate timed out before its fence."""
    s = sender()
    s.step_meta(StepMeta(push_send=[item("p1")]), 1, 0.0)  # p1 holds t1
    s.forward([item("p2")], 2)
    refused = s.poll(3, {2}, 0.1)
    assert [(a.owner, a.report) for a in refused if isinstance(a, Free)] == [("p2", False)]
    s.forward([item("p2")], 2)
    assert not s.busy() and s.poll(4, {2}, 0.2) == []
    assert reports(s.step_meta(StepMeta(push_abort_p=[("t1", "p2")]), 5, 0.3)) == ["p2"]

    s = sender(layerwise=True)
    s.step_meta(StepMeta(push_ready=[item()]), 1, 0.0)
    s.poll(2, set(), WRITE_TIMEOUT)  # the gate is dropped; the matcher still holds p1
    s.forward([item()], 1)
    assert not s.busy()
    out = s.step_meta(StepMeta(push_abort_p=[("t1", "p1")]), 3, WRITE_TIMEOUT + 0.1)
    assert reports(out) == ["p1"] and s.num_tracked == 0


# -- stateful model check -----------------------------------------------------------------

TIDS = ["t0", "t1", "t2"]


class SenderMachine(RuleBasedStateMachine):
    """Requests r0, r1, ... (transfer ids drawn from a few, so some collide) go through
    every path in random order; D registers, aborts; fences pass; steps begin; WRITEs end."""

    @initialize(layerwise=st.booleans())
    def start(self, layerwise: bool) -> None:
        self.s = sender(layerwise)
        self.now = 0.0
        self.step = 0  # engine steps begun
        self.passed: set[int] = set()  # steps whose forward fence passed
        self.reqs: dict[str, PushSend] = {}
        self.last_chunk: dict[str, int] = {}  # owner -> step computing its last chunk
        self.finished: set[str] = set()
        self.finished_ok: set[str] = set()  # by push_send: the matcher got its blocks
        self.preempted: set[str] = set()  # since its last chunk was computed
        self.writing: dict[str, Write] = {}  # tid -> WRITE started and not ended
        self.started: Counter[str] = Counter()
        self.reported: Counter[str] = Counter()
        self.registered_tids: set[str] = set()
        self.served: set[str] = set()  # tids whose WRITE completed
        self.rejected: set[str] = set()  # tids whose D was told
        self.bad_prompt: set[str] = set()

    def _apply(self, actions) -> None:
        for a in actions:
            if isinstance(a, Write):
                tid, owner = a.start.transfer_id, a.start.owner
                self.started[tid] += 1
                assert self.started[tid] == 1, "a second WRITE for one transfer id"
                assert owner not in self.preempted, "WRITE off blocks vLLM freed"
                assert a.reg.prompt_hash == self.reqs[owner].prompt_hash
                if a.gate is not None:
                    assert self.s.layerwise and not a.gate.opened
                    assert a.gate.item.req_id == owner
                elif owner not in self.finished:  # early push: its forward is done
                    k = self.last_chunk[owner]  # and a later step began
                    assert k in self.passed and self.step > k, "early WRITE before its time"
                self.writing[tid] = a
            elif isinstance(a, Free):
                if a.report:
                    assert a.owner in self.finished, "freed before the scheduler finished it"
                    assert all(w.start.owner != a.owner for w in self.writing.values()), \
                        "freed under an in-flight WRITE"
                    self.reported[a.owner] += 1
                    assert self.reported[a.owner] == 1, "freed twice"
            elif isinstance(a, RejectD):
                assert a.transfer_id not in self.writing, "rejected while a WRITE may land"
                if a.reg is not None:
                    self.rejected.add(a.transfer_id)
            elif isinstance(a, FailWrite):
                self._end_write(a.transfer_id, ok=False)
            elif isinstance(a, Mark):  # a forward is done and a later step began
                assert any(self.reqs[o].transfer_id == a.transfer_id and k in self.passed
                           and self.step > k for o, k in self.last_chunk.items())

    def _end_write(self, tid: str, ok: bool) -> None:
        w = self.writing.pop(tid)
        if ok:
            self.served.add(tid)
            self._apply(self.s.write_done(tid, self.now))
        else:
            self._apply(self.s.write_failed(tid, "x", self.now))
        assert w.start.transfer_id == tid

    def _live(self) -> list[str]:
        return sorted(set(self.reqs) - self.finished)

    @rule(tid=st.sampled_from(TIDS), other_prompt=st.booleans())
    def new_request(self, tid: str, other_prompt: bool) -> None:
        owner = f"r{len(self.reqs)}"
        prompt = "other" if other_prompt else "h"
        self.reqs[owner] = PushSend(owner, tid, [5, 6, 7], 40, prompt)

    @precondition(lambda self: any(o not in self.last_chunk for o in self._live()))
    @rule(data=st.data())
    def compute_last_chunk(self, data) -> None:
        """A step begins that computes a request's last chunk (push_ready): once, or again
        after a preemption."""
        owner = data.draw(st.sampled_from([o for o in self._live() if o not in self.last_chunk]))
        self.step += 1
        self.last_chunk[owner] = self.step
        self.preempted.discard(owner)
        self._apply(self.s.step_meta(StepMeta(push_ready=[self.reqs[owner]]), self.step,
                                     self.now))

    @precondition(lambda self: any(o in self.last_chunk for o in self._live()))
    @rule(data=st.data())
    def forward_reported(self, data) -> None:
        owner = data.draw(st.sampled_from([o for o in self._live() if o in self.last_chunk]))
        self.s.forward([self.reqs[owner]], self.last_chunk[owner])

    @precondition(lambda self: self._live())
    @rule(data=st.data(), ok=st.booleans())
    def scheduler_finishes(self, data, ok: bool) -> None:
        owner = data.draw(st.sampled_from(self._live()))
        s = self.reqs[owner]
        self.finished.add(owner)
        if ok:
            self.finished_ok.add(owner)
        self.step += 1
        meta = StepMeta(push_send=[s]) if ok else StepMeta(push_abort_p=[(s.transfer_id, owner)])
        self._apply(self.s.step_meta(meta, self.step, self.now))

    @precondition(lambda self: any(o in self.last_chunk for o in self._live()))
    @rule(data=st.data())
    def preempt(self, data) -> None:
        owner = data.draw(st.sampled_from([o for o in self._live() if o in self.last_chunk]))
        self.preempted.add(owner)
        del self.last_chunk[owner]
        self.step += 1
        meta = StepMeta(push_preempted=[(self.reqs[owner].transfer_id, owner)])
        self._apply(self.s.step_meta(meta, self.step, self.now))

    @rule()
    def next_step(self) -> None:
        self.step += 1

    @precondition(lambda self: set(self.last_chunk.values()) - self.passed)
    @rule(data=st.data())
    def fence_passes(self, data) -> None:
        """The forward computing some request's last chunk completes on the device."""
        self.passed.add(data.draw(st.sampled_from(sorted(set(self.last_chunk.values())
                                                          - self.passed))))

    @rule()
    def poll(self) -> None:
        self._apply(self.s.poll(self.step, set(self.passed), self.now))

    @rule(tid=st.sampled_from(TIDS), other_prompt=st.booleans(), bad_size=st.booleans())
    def d_registers(self, tid: str, other_prompt: bool, bad_size: bool) -> None:
        if tid in self.registered_tids:
            return  # D registers a transfer id once (a retry is a new id)
        self.registered_tids.add(tid)
        r = reg(tid, "other" if other_prompt else "h", BS * 2 if bad_size else BS)
        self._apply(self.s.registered(r, self.now))

    @rule(tid=st.sampled_from(TIDS))
    def d_aborts(self, tid: str) -> None:
        self._apply(self.s.aborted(tid, self.now))

    @precondition(lambda self: self.writing)
    @rule(data=st.data(), ok=st.booleans())
    def write_ends(self, data, ok: bool) -> None:
        tid = data.draw(st.sampled_from(sorted(self.writing)))
        gate = self.writing[tid].gate
        # The transfer thread commits a layer-wise WRITE only once its gate opened.
        self._end_write(tid, ok and (gate is None or gate.opened))

    @rule(dt=st.sampled_from([0.01, 1.0, 3.0, 5.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self._apply(self.s.tick(self.now))

    @invariant()
    def gates_only_for_last_chunks_not_preempted(self) -> None:
        if hasattr(self, "s"):
            assert self.s.gate_steps() <= set(self.last_chunk.values())

    @invariant()
    def gates_open_only_after_their_forward(self) -> None:
        for w in self.writing.values():
            g = w.gate
            if g is not None and g.opened:
                assert g.reported and g.step in self.passed and self.step > g.step

    def teardown(self) -> None:
        if not hasattr(self, "s"):
            return
        for owner in self._live():  # every request ends
            self.finished.add(owner)
            self.finished_ok.add(owner)
            self.step += 1
            self._apply(self.s.step_meta(StepMeta(push_send=[self.reqs[owner]]), self.step,
                                         self.now))
        for _ in range(3):  # fences pass, steps begin, WRITEs end, timeouts fire
            self.passed |= set(range(1, self.step + 1))
            self.step += 1
            self._apply(self.s.poll(self.step, set(self.passed), self.now))
            for tid in sorted(self.writing):
                gate = self.writing[tid].gate
                self._end_write(tid, gate is None or gate.opened)
            self.now += 10.0
            self._apply(self.s.tick(self.now))
        assert self.s.num_tracked == 0 and self.s.num_unfinished == 0
        assert not self.s.busy() and not self.s.awaiting() and self.s.matcher.num_live == 0
        for owner in self.finished_ok:  # every prefill handed over is freed, once
            assert self.reported[owner] == 1, owner
        for tid in self.registered_tids:  # D is served or told, never left waiting
            assert tid in self.served or tid in self.rejected, tid


SenderMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                           deadline=None)
test_sender_model = SenderMachine.TestCase
