"""Push protocol, P side (protocol/push_match.py): every ordering, duplicate, block size,
validation, timeout and abort of the matcher, and a transfer id claimed by a second P request."""

from __future__ import annotations

import pytest
from helpers_push import BS, dest, kinds, m

from kvferry.connectors.protocol.push_match import (
    FreeBlocks,
    PushMatcher,
    Reject,
    StartWrite,
    validate_destination,
)

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
