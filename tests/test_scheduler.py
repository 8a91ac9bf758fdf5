"""Scheduler-side pull protocol (connectors/scheduling/scheduler.py TransferScheduler), no vLLM, no I/O."""

from __future__ import annotations

import pytest

from kvferry.connectors.protocol.params import (
    SECRET_ENV,
    SIG,
    InvalidParams,
    RemotePrefill,
    parse_offer,
    prompt_hash,
    sign,
)
from kvferry.connectors.protocol.step import RecvTask, StepMeta
from kvferry.connectors.scheduling.scheduler import TransferScheduler

BS = 4


@pytest.fixture(autouse=True)
def _secret(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "test-secret")


def P(tp: int = 1) -> TransferScheduler:
    return TransferScheduler("P0", "10.0.0.1", 5600, BS, tp)


def D(tp: int = 1) -> TransferScheduler:
    return TransferScheduler("D0", "10.0.0.2", 5700, BS, tp)


PROMPT = list(range(100, 110))  # 10 tokens -> 3 blocks of 4
P_BLOCKS = [11, 12, 13]


def p_offer(prompt=PROMPT, blocks=P_BLOCKS, tp: int = 1, req="p-req", **params) -> dict:
    ok, offer = P(tp).finished(req, True, blocks, {"do_remote_decode": True, **params}, prompt)
    assert ok and offer is not None
    return offer


# -- P side ------------------------------------------------------------------------------------
def test_p_publishes_signed_offer_for_finished_remote_decode_request():
    p = P()
    keep, params = p.finished("r1", True, P_BLOCKS, {"do_remote_decode": True, "transfer_id": "t9"}, PROMPT)
    assert keep is True and params is not None and SIG in params
    o = parse_offer(params)  # verifies with KVFERRY_SECRET from the env
    assert o == RemotePrefill(remote_engine_id="P0", remote_host="10.0.0.1", remote_port=5600,
                              remote_block_ids=P_BLOCKS, remote_request_id="r1",
                              remote_num_tokens=10, prompt_hash=prompt_hash(PROMPT),
                              remote_tp_size=1, transfer_id="t9")
    assert o.do_remote_prefill and not o.do_remote_decode
    assert p.waiting_send == {"r1"}
    meta = p.take_meta()
    assert meta.send == ["r1"] and meta.recv == []


@pytest.mark.parametrize("ok,blocks,params", [
    (False, P_BLOCKS, {"do_remote_decode": True}),     # aborted / errored
    (True, [], {"do_remote_decode": True}),            # no blocks to keep
    (True, P_BLOCKS, {"do_remote_decode": False}),
    (True, P_BLOCKS, {}),
    (True, P_BLOCKS, None),
    (True, P_BLOCKS, {"do_remote_prefill": True}),     # a D-style request
])
def test_p_keeps_nothing_unless_ok_remote_decode_with_blocks(ok, blocks, params):
    p = P()
    assert p.finished("r1", ok, blocks, params, PROMPT) == (False, None)
    assert p.waiting_send == set()
    assert p.take_meta() == StepMeta()


def test_p_offer_blocks_are_a_copy_of_the_callers_list():
    p = P()
    blocks = [1, 2, 3]
    _, params = p.finished("r1", True, blocks, {"do_remote_decode": True}, PROMPT)
    blocks.append(99)
    assert params["remote_block_ids"] == [1, 2, 3]


def test_p_worker_done_frees_only_reported_requests():
    p = P()
    for r in ("a", "b", "c"):
        p.finished(r, True, P_BLOCKS, {"do_remote_decode": True}, PROMPT)
    p.worker_done({"a", "c", "unknown"})
    assert p.waiting_send == {"b"}
    p.worker_done(set())
    assert p.waiting_send == {"b"}


def test_take_meta_resets():
    p = P()
    p.finished("a", True, P_BLOCKS, {"do_remote_decode": True}, PROMPT)
    first = p.take_meta()
    assert first.send == ["a"]
    assert p.take_meta() == StepMeta()
    p.finished("b", True, P_BLOCKS, {"do_remote_decode": True}, PROMPT)
    assert p.take_meta().send == ["b"] and first.send == ["a"]


# -- D side: accept ----------------------------------------------------------------------------
def test_d_valid_offer_loads_whole_prompt_then_reads_all_blocks():
    d, offer = D(), p_offer()
    assert d.matched_tokens("d1", PROMPT, offer, 0) == (10, True)
    assert d.rejection("d1") is None
    d.after_alloc("d1", [7, 8, 9], 10)
    meta = d.take_meta()
    assert meta.send == [] and len(meta.recv) == 1
    t = meta.recv[0]
    assert isinstance(t, RecvTask) and t.req_id == "d1" and not t.release_only
    assert t.local_block_ids == [7, 8, 9] and t.remote_block_ids == P_BLOCKS
    assert t.offer == parse_offer(offer)
    assert d.take_meta() == StepMeta()


def test_d_offer_with_extra_vllm_keys_is_accepted():
    offer = {**p_offer(), "some_vllm_key": 1, "another": {"x": 1}}
    assert D().matched_tokens("d1", PROMPT, offer, 0) == (10, True)


def test_d_local_prefix_hit_reduces_count_and_reads_only_blocks_beyond_hit():
    d = D()
    assert d.matched_tokens("d1", PROMPT, p_offer(), 4) == (6, True)
    d.after_alloc("d1", [7, 8, 9], 6)
    (t,) = d.take_meta().recv
    assert t.local_block_ids == [8, 9] and t.remote_block_ids == [12, 13]


def test_d_extra_allocated_blocks_beyond_prompt_are_not_read():
    d = D()
    d.matched_tokens("d1", PROMPT, p_offer(blocks=[11, 12, 13, 14]), 0)
    d.after_alloc("d1", [7, 8, 9, 10, 20], 10)
    (t,) = d.take_meta().recv
    assert t.local_block_ids == [7, 8, 9] and t.remote_block_ids == [11, 12, 13]


def test_d_matched_tokens_is_idempotent_and_tracks_latest_hit():
    d, offer = D(), p_offer()
    for _ in range(3):
        assert d.matched_tokens("d1", PROMPT, offer, 0) == (10, True)
    assert d.matched_tokens("d1", PROMPT, offer, 8) == (2, True)  # prefix cache grew meanwhile
    d.after_alloc("d1", [7, 8, 9], 2)
    (t,) = d.take_meta().recv
    assert t.local_block_ids == [9] and t.remote_block_ids == [13]


def test_d_full_local_hit_releases_p_blocks_without_reading():
    d = D()
    assert d.matched_tokens("d1", PROMPT, p_offer(), 10) == (0, False)
    d.after_alloc("d1", [7, 8, 9], 0)
    (t,) = d.take_meta().recv
    assert t.release_only and t.local_block_ids == [] and t.remote_block_ids == []
    assert t.offer.remote_request_id == "p-req"


def test_d_hit_covering_all_needed_blocks_releases_even_if_vllm_asks_for_tokens():
    d = D()
    prompt = list(range(8))  # 2 blocks exactly
    d.matched_tokens("d1", prompt, p_offer(prompt=prompt, blocks=[1, 2]), 8)
    d.after_alloc("d1", [5, 6], 3)
    (t,) = d.take_meta().recv
    assert t.release_only


def test_d_after_alloc_with_too_few_local_blocks_releases():
    d = D()
    d.matched_tokens("d1", PROMPT, p_offer(), 0)
    d.after_alloc("d1", [7, 8], 10)
    (t,) = d.take_meta().recv
    assert t.release_only and t.local_block_ids == []


def test_d_after_alloc_consumes_the_offer_once():
    d = D()
    d.matched_tokens("d1", PROMPT, p_offer(), 0)
    d.after_alloc("d1", [7, 8, 9], 10)
    d.after_alloc("d1", [7, 8, 9], 10)
    assert len(d.take_meta().recv) == 1
    assert d.finished("d1", True, [7, 8, 9], None, PROMPT) == (False, None)
    assert d.take_meta() == StepMeta()  # no stray release after a READ was queued


def test_d_finished_before_alloc_releases_p_blocks():
    d = D()
    d.matched_tokens("d1", PROMPT, p_offer(), 0)
    assert d.finished("d1", False, [], None, PROMPT) == (False, None)
    (t,) = d.take_meta().recv
    assert t.release_only and t.req_id == "d1"
    d.after_alloc("d1", [7, 8, 9], 10)  # too late: nothing more to do
    assert d.take_meta() == StepMeta()


def test_d_after_alloc_for_unknown_request_is_a_no_op():
    d = D()
    d.after_alloc("never-seen", [1, 2], 8)
    assert d.take_meta() == StepMeta()


@pytest.mark.parametrize("params", [None, {}, {"do_remote_prefill": False}, {"do_remote_decode": True}])
def test_d_non_remote_requests_load_nothing(params):
    d = D()
    assert d.matched_tokens("d1", PROMPT, params, 0) == (0, False)
    assert d.rejection("d1") is None
    d.after_alloc("d1", [1, 2, 3], 0)
    assert d.take_meta() == StepMeta()


# -- D side: reject ----------------------------------------------------------------------------
def expect_rejected(d: TransferScheduler, prompt, params, code: str):
    assert d.matched_tokens("d1", prompt, params, 0) == (0, False)
    assert d.rejection_code("d1") == code, d.rejection("d1")
    d.after_alloc("d1", [1, 2, 3], 0)
    assert d.take_meta() == StepMeta()  # a rejected offer never drives a READ or release


def test_d_rejects_offer_for_another_prompt():
    prompt_b = [*PROMPT[:-1], 999]  # same length, one token differs
    expect_rejected(D(), prompt_b, p_offer(), "prompt_mismatch")


def test_d_rejects_offer_for_another_prompt_length():
    expect_rejected(D(), [*PROMPT, 5], p_offer(), "prompt_mismatch")


def test_d_rejects_offer_with_too_few_blocks():
    expect_rejected(D(), PROMPT, p_offer(blocks=[11, 12]), "too_few_blocks")


def test_d_rejects_tp_mismatch_when_the_model_heads_are_unknown():
    expect_rejected(D(tp=2), PROMPT, p_offer(tp=1), "tp_mismatch")


def test_d_accepts_another_tp_size_whose_heads_split_and_rejects_one_that_does_not():
    d = TransferScheduler("D0", "10.0.0.2", 5700, BS, 2, num_kv_heads=8)
    assert d.matched_tokens("d1", PROMPT, p_offer(tp=4), 0) == (len(PROMPT), True)
    d.after_alloc("d1", [1, 2, 3], len(PROMPT))
    (task,) = d.take_meta().recv
    assert task.offer.remote_tp_size == 4 and task.local_block_ids == [1, 2, 3]
    d3 = TransferScheduler("D0", "10.0.0.2", 5700, BS, 2, num_kv_heads=8)
    expect_rejected(d3, PROMPT, p_offer(tp=3), "tp_mismatch")


def test_d_rejects_offer_signed_by_another_deployment(monkeypatch):
    offer = p_offer()
    monkeypatch.setenv(SECRET_ENV, "other-deployment")
    expect_rejected(D(), PROMPT, offer, "bad_signature")


def test_d_rejects_client_forged_block_ids():
    offer = {**p_offer(), "remote_block_ids": [0, 1, 2]}
    expect_rejected(D(), PROMPT, offer, "bad_signature")


def test_d_rejects_unsigned_offer():
    offer = p_offer()
    del offer[SIG]
    expect_rejected(D(), PROMPT, offer, "unsigned")


def test_d_rejects_malformed_offer():
    expect_rejected(D(), PROMPT, {"do_remote_prefill": True, SIG: "0" * 64, "remote_port": "x"},
                    "malformed")


def test_d_rejection_is_sticky_until_finished():
    d, good = D(), p_offer()
    bad = {**good, "remote_block_ids": [0, 1, 2]}
    assert d.matched_tokens("d1", PROMPT, bad, 0) == (0, False)
    assert d.matched_tokens("d1", PROMPT, good, 0) == (0, False)  # decided: recompute
    assert d.rejection_code("d1") == "bad_signature"
    d.finished("d1", True, [], None, PROMPT)
    assert d.rejection("d1") is None
    assert d.take_meta() == StepMeta()


def test_d_forged_params_signed_with_the_secret_are_still_checked_against_prompt():
    forged = sign(RemotePrefill(remote_engine_id="P0", remote_host="h", remote_port=1,
                                remote_block_ids=[1, 2, 3], remote_request_id="x",
                                remote_num_tokens=10, prompt_hash="0" * 32), b"test-secret")
    expect_rejected(D(), PROMPT, forged, "prompt_mismatch")


def test_d_non_ascii_signature_is_rejected_not_raised():
    offer = {**p_offer(), SIG: "ü" * 64}
    expect_rejected(D(), PROMPT, offer, "unsigned")


# -- end to end through both schedulers ----------------------------------------------------------
def test_p_to_d_round_trip_with_tp2():
    p, d = P(tp=2), D(tp=2)
    _, offer = p.finished("p-r", True, [4, 5, 6], {"do_remote_decode": True}, PROMPT)
    assert d.matched_tokens("d-r", PROMPT, offer, 0) == (10, True)
    d.after_alloc("d-r", [0, 1, 2], 10)
    (t,) = d.take_meta().recv
    assert t.remote_block_ids == [4, 5, 6] and t.offer.remote_request_id == "p-r"
    assert t.offer.remote_port == 5600 and t.offer.remote_tp_size == 2
    assert p.take_meta().send == ["p-r"]


def test_every_rejection_code_is_a_documented_reason():
    """Each refusal above carries one of InvalidParams.REASONS (what callers branch on)."""
    codes = set()
    for prompt, params in ((PROMPT, {**p_offer(), SIG: "ü" * 64}), ([*PROMPT, 5], p_offer()),
                           (PROMPT, p_offer(blocks=[11, 12])), (PROMPT, "not-an-object")):
        d = D()
        d.matched_tokens("d1", prompt, params, 0)
        codes.add(d.rejection_code("d1"))
    assert codes == {"unsigned", "prompt_mismatch", "too_few_blocks", "not_an_object"}
    assert codes <= set(InvalidParams.REASONS)
