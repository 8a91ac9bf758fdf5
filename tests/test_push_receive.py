"""Push protocol, D side (protocol/push_receive.py): the receiver's readiness, timeouts,
quarantine, rejects and aborts, and the cause each failure names."""

from __future__ import annotations

import pytest
from helpers_push import kinds, rx

from kvferry.connectors.protocol.push_receive import Cause, PushReceiver, RecvFailed, RecvReady, ReleaseDest

# -- D side -------------------------------------------------------------------------------


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
    assert r.tick(14.9) == []
    assert r.tick(15.0) == [ReleaseDest("t1", "r1", "quarantine over")]
    assert r.tick(100.0) == []


def test_receiver_late_wrote_after_timeout_releases_never_ready():
    """Every writer finished after D gave up: nothing more can land, the blocks go."""
    r = rx()
    r.expect("t1", "r1", {0, 1}, 0.0)
    r.notified("t1", 0)
    (f,) = r.tick(10.0)
    assert isinstance(f, RecvFailed)
    assert r.notified("t1", 1) == [ReleaseDest("t1", "r1", "P acknowledged")]
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
    assert r.tick(5.9) == []
    assert kinds(r.tick(6.0)) == ["ReleaseDest"]
    r.expect("t2", "r2", {0}, 0.0)
    assert r.abort("t2", 1.0) == []  # P's WRITE ends after the abort: released on its Wrote
    assert r.notified("t2", 0) == [ReleaseDest("t2", "r2", "P acknowledged")]
    assert r.abort("nope", 1.0) == [] and r.failed("nope", "x", 1.0) == []


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
