"""Push protocol, stateful model checks (hypothesis): random interleavings of the P-side
matcher (two owners sharing transfer ids) and of the D-side receiver keep the block,
write and release invariants."""

from __future__ import annotations

from helpers_push import BS, dest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvferry.connectors.protocol.push_match import FreeBlocks, PushMatcher, StartWrite
from kvferry.connectors.protocol.push_receive import PushReceiver, RecvFailed, RecvReady, ReleaseDest

# -- stateful model check ----------------------------------------------------------------

TIDS = [f"t{i}" for i in range(4)]


class PushMachine(RuleBasedStateMachine):
    """Random interleavings of two P requests (owners) that may share transfer ids;
    asserts the block and write invariants."""

    def __init__(self) -> None:
        super().__init__()
        self.pm = PushMatcher(BS, 100, hold_timeout=3.0, register_timeout=5.0,
                              tombstone_ttl=1000.0)
        self.now = 0.0
        self.prefilled: set[tuple[str, str]] = set()  # (tid, owner) with a prefill_done
        self.freed: dict[tuple[str, str], int] = {}
        self.writes: dict[str, int] = {}
        self.writing: dict[str, str] = {}  # tid -> owner whose blocks are being read
        self.dead: set[str] = set()  # aborted before any write started

    def _apply(self, actions) -> None:
        for a in actions:
            if isinstance(a, StartWrite):
                assert a.transfer_id not in self.dead, "write for an aborted attempt"
                assert (a.transfer_id, a.owner) in self.prefilled
                self.writes[a.transfer_id] = self.writes.get(a.transfer_id, 0) + 1
                self.writing[a.transfer_id] = a.owner
            elif isinstance(a, FreeBlocks):
                key = (a.transfer_id, a.owner)
                assert self.writing.get(a.transfer_id) != a.owner, "freed under in-flight WRITE"
                self.freed[key] = self.freed.get(key, 0) + 1

    @rule(tid=st.sampled_from(TIDS), short=st.booleans())
    def register(self, tid: str, short: bool) -> None:
        ids = ((1, 2),) if short else ((1, 2, 3),)
        self._apply(self.pm.registered(tid, dest(ids=ids), self.now))

    @rule(tid=st.sampled_from(TIDS), owner=st.sampled_from(["a", "b"]))
    def prefill(self, tid: str, owner: str) -> None:
        self.prefilled.add((tid, owner))
        self._apply(self.pm.prefill_done(tid, [5, 6, 7], 40, self.now, owner=owner))

    @rule(tid=st.sampled_from(TIDS))
    def write_done(self, tid: str) -> None:
        self.writing.pop(tid, None)
        self._apply(self.pm.write_done(tid))

    @rule(tid=st.sampled_from(TIDS))
    def write_failed(self, tid: str) -> None:
        self.writing.pop(tid, None)
        self._apply(self.pm.write_failed(tid, "x"))

    @rule(tid=st.sampled_from(TIDS), owner=st.sampled_from(["a", "b", None]))
    def abort(self, tid: str, owner: str | None) -> None:
        before = self.pm.state(tid)
        self._apply(self.pm.abort(tid, owner=owner))
        if tid not in self.writes and self.pm.state(tid) != before:
            self.dead.add(tid)
        if before == "unknown":
            self.dead.add(tid)

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0, 5.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self._apply(self.pm.tick(self.now))

    @invariant()
    def at_most_one_write_and_free(self) -> None:
        assert all(n == 1 for n in self.writes.values())
        assert all(n == 1 for n in self.freed.values())
        assert set(self.freed) <= self.prefilled

    def teardown(self) -> None:
        # Finish every in-flight write, then let all timeouts fire: every prefill freed once.
        for tid in list(self.writing):
            self.writing.pop(tid)
            self._apply(self.pm.write_done(tid))
        self.now += 100.0
        self._apply(self.pm.tick(self.now))
        assert self.freed == {k: 1 for k in self.prefilled}
        assert self.pm.num_live == 0


TestPushMachine = PushMachine.TestCase
TestPushMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


class ReceiverMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.r = PushReceiver(recv_timeout=4.0, quarantine=2.0, tombstone_ttl=1000.0)
        self.now = 0.0
        self.expected: set[str] = set()
        self.notified: dict[str, set[int]] = {}
        self.ended: dict[str, str] = {}
        self.failed_ids: set[str] = set()

    def _apply(self, actions) -> None:
        for a in actions:
            if isinstance(a, RecvReady):
                assert a.transfer_id not in self.ended
                assert a.transfer_id not in self.failed_ids
                assert self.notified.get(a.transfer_id) == {0, 1}
                self.ended[a.transfer_id] = "ready"
            elif isinstance(a, RecvFailed):
                assert a.transfer_id not in self.failed_ids
                self.failed_ids.add(a.transfer_id)
            elif isinstance(a, ReleaseDest):
                assert a.transfer_id not in self.ended
                self.ended[a.transfer_id] = "released"

    @rule(tid=st.sampled_from(TIDS))
    def expect(self, tid: str) -> None:
        if tid in self.expected:
            return
        self.expected.add(tid)
        self._apply(self.r.expect(tid, "r", {0, 1}, self.now))

    @rule(tid=st.sampled_from(TIDS), rank=st.integers(0, 2))
    def notify(self, tid: str, rank: int) -> None:
        if tid in self.expected and tid not in self.failed_ids and rank in (0, 1):
            self.notified.setdefault(tid, set()).add(rank)
        self._apply(self.r.notified(tid, rank))

    @rule(tid=st.sampled_from(TIDS))
    def fail(self, tid: str) -> None:
        self._apply(self.r.failed(tid, "x", self.now))

    @rule(tid=st.sampled_from(TIDS))
    def reject(self, tid: str) -> None:
        self._apply(self.r.rejected(tid, "x", self.now))

    @rule(tid=st.sampled_from(TIDS))
    def abort(self, tid: str) -> None:
        self._apply(self.r.abort(tid, self.now))

    @rule(dt=st.sampled_from([0.5, 2.0, 4.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self._apply(self.r.tick(self.now))

    def teardown(self) -> None:
        for _ in range(2):  # time out, then the quarantine ends
            self.now += 100.0
            self._apply(self.r.tick(self.now))
        assert set(self.ended) == self.expected  # every expect ended exactly once


TestReceiverMachine = ReceiverMachine.TestCase
TestReceiverMachine.settings = settings(max_examples=200, stateful_step_count=40,
                                        deadline=None)
