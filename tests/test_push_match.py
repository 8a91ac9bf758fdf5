"""Push protocol (protocol/push_match.py, push_receive.py): every ordering, duplicate,
timeout and abort, plus a stateful model check."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvferry.connectors.protocol.push_match import (
    Destination,
    FreeBlocks,
    PushMatcher,
    Reject,
    StartWrite,
    validate_destination,
)
from kvferry.connectors.protocol.push_receive import Cause, PushReceiver, RecvFailed, RecvReady, ReleaseDest

BS = 16


def dest(ids=((10, 11, 12),), block_size=BS, num_blocks=100, first_token=0) -> Destination:
    return Destination(ids, block_size, num_blocks, first_token)


def kinds(actions) -> list[str]:
    return [type(a).__name__ for a in actions]


def m(**kw) -> PushMatcher:
    return PushMatcher(BS, 100, hold_timeout=10.0, register_timeout=20.0,
                       tombstone_ttl=100.0, **kw)


# -- matching, both orders -------------------------------------------------------------

def test_registration_first_then_prefill_starts_write():
    pm = m()
    assert pm.registered("t1", dest(), 0.0) == []
    assert pm.state("t1") == "waiting_prefill"
    (w,) = pm.prefill_done("t1", [1, 2, 3], 40, 1.0)
    assert isinstance(w, StartWrite)
    assert w.src_block_ids == (1, 2, 3) and w.dest_block_ids == ((10, 11, 12),)
    assert (w.first_token, w.num_tokens, w.src_block_size) == (0, 40, BS)
    assert pm.state("t1") == "writing"
    (f,) = pm.write_done("t1")
    assert f == FreeBlocks("t1", (1, 2, 3), "written")
    assert pm.state("t1") == "ended:done" and pm.num_live == 0


def test_prefill_first_then_registration_starts_write():
    pm = m()
    assert pm.prefill_done("t1", [1, 2, 3], 40, 0.0) == []
    assert pm.state("t1") == "holding"
    (w,) = pm.registered("t1", dest(), 1.0)
    assert isinstance(w, StartWrite) and w.src_block_ids == (1, 2, 3)


def test_duplicates_are_idempotent():
    pm = m()
    pm.registered("t1", dest(), 0.0)
    assert pm.registered("t1", dest(), 0.5) == []
    assert kinds(pm.prefill_done("t1", [1, 2, 3], 40, 1.0)) == ["StartWrite"]
    assert pm.prefill_done("t1", [1, 2, 3], 40, 1.0) == []
    assert pm.registered("t1", dest(), 1.5) == []
    assert kinds(pm.write_done("t1")) == ["FreeBlocks"]
    assert pm.write_done("t1") == []
    assert pm.registered("t1", dest(), 2.0) == []  # served: duplicate, no Reject
    assert pm.prefill_done("t1", [1, 2, 3], 40, 2.0) == []
    assert pm.write_failed("t1", "x") == []
    assert pm.abort("t1") == []


def test_duplicate_prefill_while_holding_no_second_free():
    pm = m()
    pm.prefill_done("t1", [1, 2, 3], 40, 0.0)
    assert pm.prefill_done("t1", [1, 2, 3], 40, 0.1) == []
    assert kinds(pm.tick(10.0)) == ["FreeBlocks"]
    assert pm.tick(11.0) == []


# -- block sizes and validation ---------------------------------------------------------

def test_different_block_sizes_needed_dest_blocks():
    pm = m()
    # 40 tokens, D block size 32 -> 2 D blocks; extra registered blocks are trimmed.
    d = dest(ids=((5, 6, 7), (8, 9, 10)), block_size=32)
    pm.registered("t1", d, 0.0)
    (w,) = pm.prefill_done("t1", [1, 2, 3], 40, 0.0)
    assert w.dest_block_ids == ((5, 6), (8, 9))
    assert w.src_block_ids == (1, 2, 3)


def test_dest_too_few_blocks_rejects_and_frees():
    pm = m()
    pm.registered("t1", dest(ids=((5, 6),), block_size=16), 0.0)
    out = pm.prefill_done("t1", [1, 2, 3], 40, 0.0)  # needs 3 D blocks
    assert kinds(out) == ["FreeBlocks", "Reject"]
    assert "need 3" in out[1].reason
    assert pm.state("t1") == "ended:invalid"
    assert kinds(pm.registered("t1", dest(), 1.0)) == ["Reject"]


def test_one_short_rank_rejects():
    pm = m()
    pm.prefill_done("t1", [1, 2, 3], 40, 0.0)
    out = pm.registered("t1", dest(ids=((5, 6, 7), (8, 9))), 0.0)
    assert kinds(out) == ["FreeBlocks", "Reject"] and "rank 1" in out[1].reason


@pytest.mark.parametrize("d, why", [
    (dest(ids=((-1, 2, 3),)), "outside"),
    (dest(ids=((1, 2, 100),)), "outside"),
    (dest(ids=((1, 2.0, 3),)), "non-integer"),
    (dest(ids=()), "no destination ranks"),
    (dest(block_size=0), "block_size"),
    (dest(num_blocks=0), "num_blocks"),
    (dest(first_token=5), "first_token"),
    (dest(first_token=-16), "first_token"),
])
def test_invalid_registration_rejected(d, why):
    assert why in validate_destination(d)
    pm = m()
    (r,) = pm.registered("t1", d, 0.0)
    assert isinstance(r, Reject) and why in r.reason
    # a later prefill for the dead transfer frees at once and never writes
    assert kinds(pm.prefill_done("t1", [1, 2, 3], 40, 0.0)) == ["FreeBlocks"]


def test_invalid_registration_while_holding_frees():
    pm = m()
    pm.prefill_done("t1", [1, 2, 3], 40, 0.0)
    out = pm.registered("t1", dest(ids=((1, 2, 999),)), 0.0)
    assert kinds(out) == ["Reject", "FreeBlocks"]
    assert pm.tick(100.0) == []


@pytest.mark.parametrize("blocks, n, why", [
    ([1, 2], 40, "need 3"),
    ([1, 2, -3], 40, "outside"),
    ([1, 2, 100], 40, "outside"),
    ([1], 0, "num_tokens"),
])
def test_invalid_prefill_frees_and_rejects(blocks, n, why):
    pm = m()
    pm.registered("t1", dest(), 0.0)
    out = pm.prefill_done("t1", blocks, n, 0.0)
    assert kinds(out) == ["FreeBlocks", "Reject"] and why in out[0].reason
    pm2 = m()
    assert kinds(pm2.prefill_done("t1", blocks, n, 0.0)) == ["FreeBlocks"]


def test_first_token_offsets_both_sides():
    pm = PushMatcher(8, 100)
    # D holds 32 tokens already (2 D blocks of 16); P block size 8 -> skip 4 P blocks.
    d = dest(ids=((20, 21),), block_size=16, first_token=32)
    pm.registered("t1", d, 0.0)
    (w,) = pm.prefill_done("t1", list(range(8)), 60, 0.0)  # 60 tokens -> 8 P blocks
    assert w.src_block_ids == (4, 5, 6, 7)
    assert w.dest_block_ids == ((20, 21),) and w.first_token == 32


def test_first_token_covering_everything_rejected():
    pm = m()
    pm.registered("t1", dest(first_token=48), 0.0)
    assert kinds(pm.prefill_done("t1", [1, 2, 3], 40, 0.0)) == ["FreeBlocks", "Reject"]


def test_unbounded_num_blocks_skips_range_check():
    pm = PushMatcher(BS)
    pm.registered("t1", dest(), 0.0)
    assert kinds(pm.prefill_done("t1", [10**9, 2, 3], 40, 0.0)) == ["StartWrite"]


def test_block_size_must_be_positive():
    with pytest.raises(ValueError):
        PushMatcher(0)


# -- attempts, aborts -------------------------------------------------------------

def test_abort_before_anything_rejects_late_registration_and_frees_late_prefill():
    pm = m()
    assert pm.abort("t1") == []
    (r,) = pm.registered("t1", dest(), 0.0)
    assert isinstance(r, Reject) and "aborted" in r.reason
    assert kinds(pm.prefill_done("t1", [1, 2, 3], 40, 0.0)) == ["FreeBlocks"]
    assert pm.prefill_done("t1", [1, 2, 3], 40, 0.0) == []  # no double free


def test_abort_while_waiting_for_prefill_rejects():
    pm = m()
    pm.registered("t1", dest(), 0.0)
    assert kinds(pm.abort("t1")) == ["Reject"]
    assert kinds(pm.prefill_done("t1", [1, 2, 3], 40, 1.0)) == ["FreeBlocks"]


def test_abort_while_holding_frees_once():
    pm = m()
    pm.prefill_done("t1", [1, 2, 3], 40, 0.0)
    assert kinds(pm.abort("t1")) == ["FreeBlocks"]
    assert pm.abort("t1") == []
    assert kinds(pm.registered("t1", dest(), 1.0)) == ["Reject"]
    assert pm.tick(50.0) == []


def test_abort_during_write_defers_free_to_completion():
    pm = m()
    pm.registered("t1", dest(), 0.0)
    pm.prefill_done("t1", [1, 2, 3], 40, 0.0)
    assert pm.abort("t1") == []
    assert pm.tick(1000.0) == []  # never freed under an in-flight WRITE
    assert kinds(pm.write_done("t1")) == ["FreeBlocks"]


def test_abort_during_write_then_failure():
    pm = m()
    pm.registered("t1", dest(), 0.0)
    pm.prefill_done("t1", [1, 2, 3], 40, 0.0)
    pm.abort("t1")
    assert kinds(pm.write_failed("t1", "boom")) == ["FreeBlocks", "Reject"]


def test_retry_with_new_attempt_is_independent():
    pm = m()
    t0, t1 = "req#0", "req#1"  # the router mints a fresh transfer id per attempt
    pm.registered(t0, dest(), 0.0)
    pm.abort(t0)
    # D's stale registration for attempt 0 is rejected; attempt 1 proceeds.
    assert kinds(pm.registered(t0, dest(), 0.1)) == ["Reject"]
    pm.registered(t1, dest(), 0.2)
    (w,) = pm.prefill_done(t1, [1, 2, 3], 40, 0.3)
    assert w.transfer_id == t1
    assert kinds(pm.prefill_done(t0, [4, 5, 6], 40, 0.3)) == ["FreeBlocks"]


def test_write_failed_frees_and_rejects():
    pm = m()
    pm.registered("t1", dest(), 0.0)
    pm.prefill_done("t1", [1, 2, 3], 40, 0.0)
    out = pm.write_failed("t1", "nixl err")
    assert kinds(out) == ["FreeBlocks", "Reject"] and "nixl err" in out[1].reason
    assert pm.state("t1") == "ended:write_failed"
    assert kinds(pm.registered("t1", dest(), 1.0)) == ["Reject"]


def test_write_events_for_unknown_or_not_writing_are_ignored():
    pm = m()
    assert pm.write_done("nope") == [] and pm.write_failed("nope", "x") == []
    pm.prefill_done("t1", [1, 2, 3], 40, 0.0)
    assert pm.write_done("t1") == [] and pm.write_failed("t1", "x") == []
    assert pm.state("t1") == "holding"


# -- timeouts ----------------------------------------------------------------------------

def test_hold_timeout_boundary():
    pm = m()
    pm.prefill_done("t1", [1, 2, 3], 40, 5.0)
    assert pm.tick(14.999) == []
    out = pm.tick(15.0)
    assert kinds(out) == ["FreeBlocks"] and pm.state("t1") == "ended:hold_timeout"
    (r,) = pm.registered("t1", dest(), 15.5)  # late registration: no write
    assert isinstance(r, Reject) and "hold_timeout" in r.reason


def test_register_timeout_boundary():
    pm = m()
    pm.registered("t1", dest(), 5.0)
    assert pm.tick(24.9) == []
    assert kinds(pm.tick(25.0)) == ["Reject"]
    assert pm.state("t1") == "ended:register_timeout"
    assert kinds(pm.prefill_done("t1", [1, 2, 3], 40, 26.0)) == ["FreeBlocks"]


def test_writing_never_times_out():
    pm = m()
    pm.registered("t1", dest(), 0.0)
    pm.prefill_done("t1", [1, 2, 3], 40, 0.0)
    assert pm.tick(10_000.0) == [] and pm.state("t1") == "writing"


def test_tombstones_forgotten_after_ttl_and_bounded():
    pm = m()
    pm.abort("a", 0.0)
    assert pm.state("a") == "ended:aborted"
    pm.tick(99.0)
    assert pm.state("a") == "ended:aborted"
    pm.tick(100.0)
    assert pm.state("a") == "unknown"
    small = PushMatcher(BS, max_tombstones=3)
    for i in range(10):
        small.abort(f"t{i}", float(i))
    assert small.num_tombstones == 3 and small.state("t9") == "ended:aborted"
    assert small.state("t0") == "unknown"


def test_abort_before_any_clock_survives_first_tick():
    pm = m()
    pm.abort("t1")  # no clock seen yet
    pm.tick(1e6)
    assert pm.state("t1") == "ended:aborted"
    pm.tick(1e6 + 100.0)
    assert pm.state("t1") == "unknown"


# -- D side -------------------------------------------------------------------------------

def rx(**kw) -> PushReceiver:
    return PushReceiver(recv_timeout=10.0, quarantine=5.0, tombstone_ttl=100.0, **kw)


def test_receiver_ready_after_all_ranks():
    r = rx()
    assert r.expect("t1", "r1", {0, 1}, 0.0) == []
    assert r.notified("t1", 0) == []
    assert r.notified("t1", 0) == []  # duplicate
    assert r.notified("t1", 7) == []  # not a writing rank
    assert r.notified("t1", 1) == [RecvReady("t1", "r1")]
    assert r.notified("t1", 1) == [] and r.state("t1") == "ended:ready"
    assert r.tick(1000.0) == []


def test_receiver_ignores_unknown_and_stale():
    r = rx()
    assert r.notified("ghost", 0) == []
    r.expect("t1", "r1", {0}, 0.0)
    assert r.notified("t0", 0) == []  # other attempt's id never marks t1 ready
    assert r.expect("t1", "r1", {0}, 0.0) == []  # duplicate expect
    assert r.notified("t1", 0) == [RecvReady("t1", "r1")]
    # the id was used: a new expect with it is failed at once and safe to release
    assert kinds(r.expect("t1", "r2", {0}, 1.0)) == ["RecvFailed", "ReleaseDest"]


def test_receiver_empty_ranks_is_an_error():
    with pytest.raises(ValueError):
        rx().expect("t1", "r1", set(), 0.0)


def test_receiver_timeout_quarantines_then_releases():
    r = rx()
    r.expect("t1", "r1", {0, 1}, 0.0)
    r.notified("t1", 0)
    assert r.tick(9.9) == []
    (f,) = r.tick(10.0)
    assert isinstance(f, RecvFailed) and r.state("t1") == "quarantined"
    assert r.notified("t1", 1) == []  # late WRITE completes: never ready
    assert r.tick(14.9) == []
    assert r.tick(15.0) == [ReleaseDest("t1", "r1", "quarantine over")]
    assert r.tick(100.0) == []


def test_receiver_zero_quarantine_releases_in_same_tick():
    r = PushReceiver(recv_timeout=1.0, quarantine=0.0)
    r.expect("t1", "r1", {0}, 0.0)
    assert kinds(r.tick(1.0)) == ["RecvFailed", "ReleaseDest"]


def test_receiver_reject_releases_at_once():
    r = rx()
    r.expect("t1", "r1", {0}, 0.0)
    out = r.rejected("t1", "aborted", 1.0)
    assert kinds(out) == ["RecvFailed", "ReleaseDest"]
    assert r.rejected("t1", "again", 1.0) == [] and r.notified("t1", 0) == []


def test_receiver_local_failure_then_reject_shortens_quarantine():
    r = rx()
    r.expect("t1", "r1", {0}, 0.0)
    assert kinds(r.failed("t1", "bad", 1.0)) == ["RecvFailed"]
    assert r.failed("t1", "bad", 1.0) == []
    assert kinds(r.rejected("t1", "ack", 2.0)) == ["ReleaseDest"]
    assert r.tick(100.0) == []


def test_receiver_abort_quarantines_without_recv_failed():
    r = rx()
    r.expect("t1", "r1", {0}, 0.0)
    assert r.abort("t1", 1.0) == [] and r.abort("t1", 1.0) == []
    assert r.notified("t1", 0) == []
    assert r.tick(5.9) == []
    assert kinds(r.tick(6.0)) == ["ReleaseDest"]
    assert r.abort("nope", 1.0) == [] and r.failed("nope", "x", 1.0) == []


# -- a transfer id claimed by a second P request ------------------------------------------

def test_second_owner_of_a_live_transfer_is_freed_at_once():
    pm = m()
    assert pm.prefill_done("t1", [1, 2, 3], 40, 0.0, owner="a") == []
    (f,) = pm.prefill_done("t1", [7, 8, 9], 40, 0.5, owner="b")
    assert f == FreeBlocks("t1", (7, 8, 9), "transfer id in use by another request", "b")
    assert pm.abort("t1", 0.6, owner="b") == []  # b's abort must not end a's transfer
    (w,) = pm.registered("t1", dest(), 1.0)
    assert isinstance(w, StartWrite) and w.src_block_ids == (1, 2, 3) and w.owner == "a"
    (f2,) = pm.write_done("t1")
    assert f2.owner == "a" and f2.block_ids == (1, 2, 3)


def test_reusing_a_completed_transfer_id_frees_the_new_blocks():
    pm = m()
    pm.registered("t1", dest(), 0.0)
    pm.prefill_done("t1", [1, 2, 3], 40, 0.0, owner="a")
    pm.write_done("t1")
    assert pm.prefill_done("t1", [1, 2, 3], 40, 1.0, owner="a") == []  # duplicate event
    (f,) = pm.prefill_done("t1", [4, 5, 6], 40, 2.0, owner="b")  # a replayed request
    assert (f.owner, f.block_ids, f.reason) == ("b", (4, 5, 6), "transfer done")
    assert pm.registered("t1", dest(), 3.0) == []  # no second write into D
    assert pm.num_live == 0


def test_abort_by_the_holding_owner_frees():
    pm = m()
    pm.prefill_done("t1", [1, 2, 3], 40, 0.0, owner="a")
    (f,) = pm.abort("t1", 1.0, owner="a")
    assert f.owner == "a" and pm.state("t1") == "ended:aborted"


def test_receiver_failures_say_their_cause():
    """D decides whom to tell by the cause, never by the reason's text."""
    r = PushReceiver(recv_timeout=5.0, quarantine=1.0)
    r.expect("t1", "d1", {0}, 0.0)
    (f, rel) = r.rejected("t1", "no registration", 0.1)  # the text may say anything
    assert isinstance(f, RecvFailed) and f.cause is Cause.REJECTED and isinstance(rel, ReleaseDest)
    r.expect("t2", "d2", {0}, 0.0)
    (f,) = r.tick(5.0)
    assert f.cause is Cause.TIMED_OUT
    r.expect("t3", "d3", {0}, 0.0)
    (f,) = r.failed("t3", "rejected by nobody", 0.0)
    assert f.cause is Cause.FAILED
    (f, _) = r.expect("t1", "d4", {0}, 6.0)  # an id that ended is never written again
    assert f.cause is Cause.STALE


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
