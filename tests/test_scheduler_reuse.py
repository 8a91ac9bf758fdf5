"""Bidirectional reuse in the TransferScheduler (no vLLM): D leases a finished turn, P reads
it back on the next turn (ReuseRead) and reports what it did in its returned params."""

from __future__ import annotations

import pytest
from helpers_clock import Clock

from kvferry.connectors.protocol.params import SECRET_ENV, SIG, parse_lease, parse_offer
from kvferry.connectors.protocol.step import ReuseRead, StepMeta
from kvferry.connectors.scheduling.lease_keeper import LeaseKeeper
from kvferry.connectors.scheduling.scheduler import ReuseSettings, TransferScheduler

BS = 4
T0 = 1000.0
TTL = 100.0
GRACE = 3.0
READ_TIMEOUT = 1.5
THRESHOLD = 8
HISTORY = list(range(100, 122))  # turn 1, prompt + output: 22 tokens -> 5 full blocks
D_BLOCKS = [50, 51, 52, 53, 54, 55]
PROMPT = [*HISTORY, *range(900, 910)]  # turn 2: history + 10 new tokens = 32 tokens
P_BLOCKS = list(range(10, 18))  # 8 blocks for 32 tokens


@pytest.fixture(autouse=True)
def _secret(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "test-secret")


@pytest.fixture
def clock() -> Clock:
    return Clock()


def d_sched(clock: Clock, **kw) -> TransferScheduler:
    keeper = LeaseKeeper("D0", "boot-1", "10.0.0.2", 5800, BS, 1, ttl=TTL,
                         free_grace=GRACE, clock=clock, **kw)
    return TransferScheduler("D0", "10.0.0.2", 5700, BS, 1, leases=keeper, clock=clock)


def p_sched(clock: Clock, tp: int = 1, bs: int = BS, threshold: int = THRESHOLD) -> TransferScheduler:
    return TransferScheduler("P0", "10.0.0.1", 5600, bs, tp, clock=clock,
                             reuse=ReuseSettings(threshold=threshold, margin_s=2.0,
                                                 read_timeout_s=READ_TIMEOUT))


def lease_offer(clock: Clock, lease_id: str = "L1", history=HISTORY, computed: int | None = None
                ) -> dict:
    """Turn 1 ends on D: its finished request keeps its blocks under a signed lease."""
    d = d_sched(clock)
    keep, params = d.finished("d1", True, D_BLOCKS, {"lease": {"lease_id": lease_id}}, history[:10],
                              tokens=history, num_computed=len(history) if computed is None else computed)
    assert keep is True and params is not None
    return params["lease"]


def pull(offer: dict) -> dict:
    return {"do_remote_decode": True, "transfer_id": "t", "reuse": offer}


# -- P: what to read ---------------------------------------------------------------------------
@pytest.mark.parametrize("computed,expect", [
    (0, 20),   # D holds 5 full blocks (20 tokens) of the history
    (4, 16),   # only beyond P's own prefix hit
    (8, 12),
    (12, 8),   # exactly the threshold
    (16, 0),   # 4 tokens left: below the threshold
    (20, 0),   # local hit covers everything D has
])
def test_p_matches_leased_history_beyond_its_prefix_hit(clock, computed, expect):
    p = p_sched(clock)
    assert p.matched_tokens("p1", PROMPT, pull(lease_offer(clock)), computed) == (expect, expect > 0)


def test_p_never_reads_the_last_prompt_token(clock):
    p = p_sched(clock)
    prompt = HISTORY[:20]  # the whole prompt is leased: its last block must be computed
    assert p.matched_tokens("p1", prompt, pull(lease_offer(clock)), 0) == (16, True)
    p2 = p_sched(clock)
    assert p2.matched_tokens("p2", HISTORY[:21], pull(lease_offer(clock, "L2")), 0) == (20, True)


def test_p_after_alloc_emits_reuse_read(clock):
    p = p_sched(clock)
    offer = lease_offer(clock)
    assert p.matched_tokens("p1", PROMPT, pull(offer), 8) == (12, True)
    clock.t += 0.25
    p.after_alloc("p1", P_BLOCKS, 12)
    meta = p.take_meta()
    assert meta.reuse == [ReuseRead("p1", [12, 13, 14], [52, 53, 54], "D0", "boot-1", "10.0.0.2",
                                    5800, T0 + 0.25 + READ_TIMEOUT, 1, "L1", 5801)]  # D's
    # lease and control port (side channel + TP size by default): P checks before reading
    assert meta.recv == [] and meta.send == [] and meta.free == []
    assert p.take_meta() == StepMeta()
    p.after_alloc("p1", P_BLOCKS, 12)  # consumed once
    assert p.take_meta() == StepMeta()


def test_p_reports_reused_tokens_after_a_good_read(clock):
    p = p_sched(clock)
    p.matched_tokens("p1", PROMPT, pull(lease_offer(clock)), 0)
    p.after_alloc("p1", P_BLOCKS, 20)
    (read,) = p.take_meta().reuse
    assert read.local_block_ids == P_BLOCKS[:5] and read.remote_block_ids == D_BLOCKS[:5]
    p.worker_done(set(), {"p1"}, {99})  # a failed block of another request
    keep, params = p.finished("p1", True, P_BLOCKS, pull({}), PROMPT)
    assert keep is True
    assert params["reused_tokens"] == 20 and params["reuse_reason"] == "ok"
    o = parse_offer(params)  # the pull offer for D is still valid with the report in it
    assert o.remote_block_ids == P_BLOCKS and o.transfer_id == "t"


def test_p_failed_read_reports_read_failed(clock):
    p = p_sched(clock)
    p.matched_tokens("p1", PROMPT, pull(lease_offer(clock)), 8)
    p.after_alloc("p1", P_BLOCKS, 12)
    p.worker_done(set(), {"p1"}, {13})
    _, params = p.finished("p1", True, P_BLOCKS, pull({}), PROMPT)
    assert params["reused_tokens"] == 0 and params["reuse_reason"] == "read_failed"


def test_p_not_allocated(clock):
    p = p_sched(clock)
    p.matched_tokens("p1", PROMPT, pull(lease_offer(clock)), 0)
    p.after_alloc("p1", P_BLOCKS, 0)
    assert p.take_meta().reuse == []
    _, params = p.finished("p1", True, P_BLOCKS, pull({}), PROMPT)
    assert params["reused_tokens"] == 0 and params["reuse_reason"] == "not_allocated"


def test_p_push_request_reports_reuse_too(clock):
    p = p_sched(clock)
    p.matched_tokens("p1", PROMPT, {"do_remote_decode": True, "push": True, "transfer_id": "t",
                                    "reuse": lease_offer(clock)}, 0)
    p.after_alloc("p1", P_BLOCKS, 20)
    p.worker_done(set(), {"p1"})
    keep, params = p.finished("p1", True, P_BLOCKS, {"do_remote_decode": True, "push": True,
                                                     "transfer_id": "t"}, PROMPT)
    assert keep is True
    assert params == {"transfer_id": "t", "push": True, "reused_tokens": 20, "reuse_reason": "ok"}


def test_report_is_per_request_and_consumed(clock):
    p = p_sched(clock)
    offer = lease_offer(clock)
    for rid in ("p1", "p2"):
        p.matched_tokens(rid, PROMPT, pull(offer), 0)
        p.after_alloc(rid, P_BLOCKS, 20)
    p.worker_done(set(), {"p1"}, {10})
    p.worker_done(set(), {"p2"})
    _, params = p.finished("p1", True, P_BLOCKS, pull({}), PROMPT)
    assert params["reuse_reason"] == "read_failed"
    _, params = p.finished("p2", True, P_BLOCKS, pull({}), PROMPT)
    assert params["reuse_reason"] == "ok" and params["reused_tokens"] == 20
    _, params = p.finished("p1", True, P_BLOCKS, pull({}), PROMPT)
    assert "reuse_reason" not in params and "reused_tokens" not in params


# -- P: when not to read -----------------------------------------------------------------------
def tampered(clock: Clock) -> dict:
    return {**lease_offer(clock), "block_ids": [0, 1, 2, 3, 4]}


def unsigned(clock: Clock) -> dict:
    return {k: v for k, v in lease_offer(clock).items() if k != SIG}


def other_deployment(clock: Clock, monkeypatch) -> dict:
    monkeypatch.setenv(SECRET_ENV, "other")
    offer = lease_offer(clock)
    monkeypatch.setenv(SECRET_ENV, "test-secret")
    return offer


@pytest.mark.parametrize("case,reason", [
    ("tampered", "invalid_offer"),
    ("unsigned", "invalid_offer"),
    ("other_deployment", "invalid_offer"),
    ("not_a_dict", "invalid_offer"),
    ("wrong_tp", "invalid_offer"),
    ("wrong_block_size", "invalid_offer"),
    ("expiring", "lease_expiring"),
    ("expired", "lease_expiring"),
    ("below_threshold", "below_threshold"),
    ("prefix_mismatch", "prefix_mismatch"),
    ("local_hit_covers", "local_hit_covers"),
])
def test_p_refuses_reuse_with_reason(clock, monkeypatch, case, reason):
    offer = lease_offer(clock)
    prompt, computed, p = PROMPT, 0, p_sched(clock)
    if case == "tampered":
        offer = tampered(clock)
    elif case == "unsigned":
        offer = unsigned(clock)
    elif case == "other_deployment":
        offer = other_deployment(clock, monkeypatch)
    elif case == "not_a_dict":
        offer = "L1"
    elif case == "wrong_tp":
        p = p_sched(clock, tp=2)
    elif case == "wrong_block_size":
        p = p_sched(clock, bs=8)
    elif case == "expiring":
        clock.t = parse_lease(offer).expiry - 2.0  # the lease must outlive the margin
    elif case == "expired":
        clock.t = parse_lease(offer).expiry + 1.0
    elif case == "below_threshold":
        p = p_sched(clock, threshold=24)
    elif case == "prefix_mismatch":
        prompt = [*PROMPT]
        prompt[1] = 0  # the client edited turn 1's first block
    elif case == "local_hit_covers":
        computed = 20
    params = pull(offer)
    assert p.matched_tokens("p1", prompt, params, computed) == (0, False)
    p.after_alloc("p1", P_BLOCKS, 0)
    assert p.take_meta().reuse == []
    keep, out = p.finished("p1", True, P_BLOCKS, params, prompt)
    assert keep is True
    assert out["reused_tokens"] == 0 and out["reuse_reason"] == reason
    assert parse_offer(out).remote_block_ids == P_BLOCKS  # the turn itself goes on


def test_p_partial_prefix_match_reads_only_matching_blocks(clock):
    prompt = [*PROMPT]
    prompt[13] = 0  # block 3 differs: blocks 0..2 still match
    p = p_sched(clock)
    assert p.matched_tokens("p1", prompt, pull(lease_offer(clock)), 0) == (12, True)
    p.after_alloc("p1", P_BLOCKS, 12)
    (read,) = p.take_meta().reuse
    assert read.local_block_ids == [10, 11, 12] and read.remote_block_ids == [50, 51, 52]


def test_p_margin_boundary(clock):
    offer = lease_offer(clock)
    expiry = parse_lease(offer).expiry
    clock.t = expiry - 2.01
    assert p_sched(clock).matched_tokens("p1", PROMPT, pull(offer), 0) == (20, True)
    clock.t = expiry - 2.0
    assert p_sched(clock).matched_tokens("p1", PROMPT, pull(offer), 0) == (0, False)


@pytest.mark.parametrize("params", [
    {"do_remote_decode": True, "transfer_id": "t"},
    {"do_remote_decode": True, "transfer_id": "t", "reuse": None},
])
def test_p_without_offer_reports_nothing(clock, params):
    p = p_sched(clock)
    assert p.matched_tokens("p1", PROMPT, params, 0) == (0, False)
    _, out = p.finished("p1", True, P_BLOCKS, params, PROMPT)
    assert "reuse_reason" not in out and "reused_tokens" not in out


# -- D: leases ---------------------------------------------------------------------------------
def test_d_leases_finished_turn_and_frees_after_release(clock):
    d = d_sched(clock)
    keep, params = d.finished("d1", True, D_BLOCKS, {"lease": {"lease_id": "L1", "ttl": 30}},
                              HISTORY[:10], tokens=HISTORY, num_computed=21)
    assert keep is True and set(params) == {"lease"}
    o = parse_lease(params["lease"])
    assert o.lease_id == "L1" and o.block_ids == D_BLOCKS[:5] and o.num_tokens == 20
    assert o.expiry == T0 + 30 and (o.host, o.port) == ("10.0.0.2", 5800)
    assert d.take_meta().free == []
    clock.t += 5
    d.leases.info("L1", for_read=True)  # P asks before its READ: the blocks outlive that READ
    d.leases.release("L1")
    clock.t += GRACE - 0.5
    assert d.take_meta().free == []
    clock.t += 0.5
    assert d.take_meta().free == ["d1"]
    clock.t += 1
    assert d.take_meta().free == []


def test_d_lease_frees_after_expiry(clock):
    d = d_sched(clock)
    d.finished("d1", True, D_BLOCKS, {"lease": {"lease_id": "L1"}}, HISTORY[:10], tokens=HISTORY,
               num_computed=22)
    clock.t = T0 + TTL - 0.5
    d.leases.info("L1", for_read=True)  # P's last check before a READ
    clock.t = T0 + TTL
    assert d.take_meta().free == []
    clock.t = T0 + TTL - 0.5 + GRACE
    assert d.take_meta().free == ["d1"]


def test_d_lease_nobody_read_frees_at_expiry(clock):
    d = d_sched(clock)
    d.finished("d1", True, D_BLOCKS, {"lease": {"lease_id": "L1"}}, HISTORY[:10], tokens=HISTORY,
               num_computed=22)
    clock.t = T0 + TTL - 1
    assert d.take_meta().free == []
    clock.t = T0 + TTL
    assert d.take_meta().free == ["d1"]


@pytest.mark.parametrize("ok,blocks,lease,computed", [
    (False, D_BLOCKS, {"lease_id": "L1"}, 22),  # aborted turn: nothing to reuse
    (True, [], {"lease_id": "L1"}, 22),
    (True, D_BLOCKS, {"lease_id": 3}, 22),      # malformed lease request
    (True, D_BLOCKS, "L1", 22),
    (True, D_BLOCKS, {"lease_id": "L1"}, 3),    # not a full block of KV
])
def test_d_keeps_nothing_without_a_grantable_lease(clock, ok, blocks, lease, computed):
    d = d_sched(clock)
    assert d.finished("d1", ok, blocks, {"lease": lease}, HISTORY[:10], tokens=HISTORY,
                      num_computed=computed) == (False, None)
    assert d.leases.num_blocks == 0
    clock.t += TTL + GRACE
    assert d.take_meta() == StepMeta()


def test_d_without_keeper_ignores_lease_requests(clock):
    d = TransferScheduler("D0", "10.0.0.2", 5700, BS, 1, clock=clock)
    assert d.finished("d1", True, D_BLOCKS, {"lease": {"lease_id": "L1"}}, HISTORY[:10],
                      tokens=HISTORY, num_computed=22) == (False, None)
    assert d.take_meta() == StepMeta()


def test_full_turn_d_to_p_to_d(clock):
    """Turn 1 leased on D, turn 2 read back by P, D frees turn 1 once the router releases it."""
    d = d_sched(clock)
    _, dp = d.finished("d1", True, D_BLOCKS, {"lease": {"lease_id": "L1"}}, HISTORY[:10],
                       tokens=HISTORY, num_computed=22)
    p = p_sched(clock)
    assert p.matched_tokens("p2", PROMPT, pull(dp["lease"]), 4) == (16, True)
    p.after_alloc("p2", P_BLOCKS, 16)
    (read,) = p.take_meta().reuse
    assert read.remote_block_ids == D_BLOCKS[1:5] and read.local_block_ids == P_BLOCKS[1:5]
    p.worker_done(set(), {"p2"})
    _, pp = p.finished("p2", True, P_BLOCKS, pull({}), PROMPT)
    assert (pp["reused_tokens"], pp["reuse_reason"]) == (16, "ok")
    clock.t += 1
    d.leases.release("L1")
    clock.t += GRACE
    assert d.take_meta().free == ["d1"]
