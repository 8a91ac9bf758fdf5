"""Block checksums (memory/checksum.py) and the reader's check of a READ (transfer/verify.py).

The checksums themselves on DRAM tensors; then real NIXL READs between two in-process
workers (tests/helpers_workers.py) with checks on: equal KV is delivered, a byte flipped in
the landed blocks (the test-only ``corrupt`` fault) is caught and recomputed, and with
checks off the same flip goes through unseen (what the checks are for). The same for push
WRITEs: P sends its source blocks' sums once its WRITE ended, D compares.
"""

from __future__ import annotations

import time

import helpers_workers
import pytest
import torch
from helpers_http import free_port
from helpers_workers import (
    BS,
    D_BLOCKS,
    P_BLOCKS,
    N,
    caches,
    d_register,
    d_task,
    install_fault_plan,
    p_done,
    p_finish,
    written,
)

from kvferry.connectors.memory.backends import VRAM, CpuBackend, KVLayout, Plane, Region
from kvferry.connectors.memory.checksum import BlockSums
from kvferry.connectors.protocol import messages
from kvferry.connectors.transfer import verify

engines = helpers_workers.engines  # in-process P and D workers over real NIXL
pytestmark = pytest.mark.timeout(60)


def sums_of(kv: dict[str, torch.Tensor]) -> BlockSums:
    return BlockSums(CpuBackend().describe(kv, N, BS))


def test_equal_bytes_give_equal_sums_and_one_flipped_byte_changes_its_block() -> None:
    kv = caches(3)
    base = sums_of(kv).sums(range(N))
    assert len(set(base)) == N  # random blocks: all different
    copy = {k: v.clone() for k, v in kv.items()}
    assert sums_of(copy).sums(range(N)) == base  # other memory, same bytes
    for name, where in (("l0", (1, 5, 2, 1)), ("l1", (9, 0, 3, 7))):  # V of l0; l1's block
        changed = {k: v.clone() for k, v in kv.items()}
        changed[name].view(torch.uint8)[where] ^= 0x10  # one bit of one byte
        got = sums_of(changed).sums(range(N))
        block = where[1] if name == "l0" else where[0]
        assert [i for i in range(N) if got[i] != base[i]] == [block]


def test_sums_follow_block_order_and_catch_swapped_blocks_and_planes() -> None:
    kv = caches(4)
    s = sums_of(kv)
    base = s.sums(range(N))
    assert s.sums([7, 2, 7]) == [base[7], base[2], base[7]]
    swapped = {k: v.clone() for k, v in kv.items()}
    swapped["l1"][[3, 4]] = swapped["l1"][[4, 3]]  # a block landed in another's place
    got = sums_of(swapped).sums(range(N))
    assert got[3] != base[3] and got[4] != base[4]
    kv_swap = {k: v.clone() for k, v in kv.items()}
    kv_swap["l0"][:, 6] = kv_swap["l0"][[1, 0], 6]  # K and V of block 6 exchanged
    assert sums_of(kv_swap).sums([6]) != [base[6]]


def test_block_ids_outside_the_cache_are_refused() -> None:
    s = sums_of(caches(5))
    with pytest.raises(IndexError):
        s.sums([0, N])
    with pytest.raises(IndexError):
        s.sums([-1])
    reply = verify.answer(s, verify.request([N + 3]))
    assert b"IndexError" in reply  # the source answers why, never raises
    assert verify.answer(s, verify.SUMS + b"\xc1garbage").count(b"ok") == 1


def test_memory_without_a_host_view_is_reported_not_read() -> None:
    """Neuron HBM registered as VRAM (no CUDA here): no checksums, and a reason to count."""
    assert not BlockSums(None).available and BlockSums(None).why_not
    hbm = KVLayout(regions=(Region(0x10000, 4096, 0, VRAM),),
                   planes=(Plane(0, 0x10000, 256, 256, 16),), num_blocks=16, block_size=4)
    s = BlockSums(hbm)
    assert not s.available and "VRAM" in s.why_not
    with pytest.raises(RuntimeError):
        s.sums([0])


def test_flip_byte_changes_exactly_that_block() -> None:
    kv = caches(6)
    s = sums_of(kv)
    before = s.sums(range(N))
    s.flip_byte(11)
    after = s.sums(range(N))
    assert [i for i in range(N) if before[i] != after[i]] == [11]


def test_sample_mode_checks_about_its_fraction_and_the_same_ids_everywhere() -> None:
    ids = [f"cmpl-{i}" for i in range(20_000)]
    picked = [i for i in ids if verify.wanted("sample", 0.05, i)]
    assert 0.04 < len(picked) / len(ids) < 0.06
    assert picked == [i for i in ids if verify.wanted("sample", 0.05, i)]  # deterministic
    assert all(verify.wanted("all", 0.0, i) for i in ids[:100])
    assert not any(verify.wanted("off", 1.0, i) for i in ids[:100])


def test_a_source_that_does_not_answer_ends_the_check_unanswered(monkeypatch) -> None:
    monkeypatch.setattr(verify, "ANSWER_S", 0.3)
    check = verify.Check("127.0.0.1", free_port(), [1, 2], [5, 6], time.monotonic())
    t0 = time.monotonic()
    while not (got := check.poll())[0]:
        time.sleep(0.01)
        assert time.monotonic() - t0 < 5
    assert got[1] is not None and got[1].startswith("unanswered")


@pytest.fixture
def hooks(monkeypatch, tmp_path):
    return install_fault_plan(monkeypatch, tmp_path, "d")


def _pull(engines, mode: str):
    p = engines("P", seed=11, kv_checksums=mode)
    d = engines("D", kv_checksums=mode)
    offer = p_finish(p, "p-req", P_BLOCKS)
    p.worker.submit(p.sched.take_meta())
    d.worker.submit(d_task(d, "d-req", offer, D_BLOCKS))
    return p, d


def test_a_checked_read_delivers_the_kv_and_frees_p(engines) -> None:
    p, d = _pull(engines, "all")
    got = d.collect(lambda r: "d-req" in r.recvd, 10)
    assert got.bad_blocks == set() and written(d, p, D_BLOCKS, P_BLOCKS)
    stats = d.worker.stats.snapshot()
    assert stats["checksums_verified"] == 1 and stats["checksum_mismatches"] == 0
    assert p.collect(lambda r: "p-req" in r.sent, 10).sent == {"p-req"}


def test_a_corrupted_read_is_caught_recomputed_and_p_still_freed(engines, hooks) -> None:
    hooks([{"point": "corrupt", "action": "flip", "p": 1.0}])
    p, d = _pull(engines, "all")
    got = d.collect(lambda r: "d-req" in r.recvd, 10)
    assert got.bad_blocks == set(D_BLOCKS)  # vLLM recomputes these
    stats = d.worker.stats.snapshot()
    assert (stats["corruptions_injected"], stats["checksum_mismatches"]) == (1, 1)
    assert stats["checksums_verified"] == 0 and stats["reads_done"] == 0
    (why,) = [e.detail for e in stats.events if e.name == "checksum_mismatches"]
    assert why.startswith("mismatch in 1 of 6 blocks"), why
    assert p.collect(lambda r: "p-req" in r.sent, 10).sent == {"p-req"}


def test_without_checks_the_same_flip_goes_through_unseen(engines, hooks) -> None:
    """What the checks are for: the corrupt fault really changes the KV D uses."""
    hooks([{"point": "corrupt", "action": "flip", "p": 1.0}])
    p, d = _pull(engines, "off")
    got = d.collect(lambda r: "d-req" in r.recvd, 10)
    assert got.bad_blocks == set()  # delivered: nothing compared it
    stats = d.worker.stats.snapshot()
    assert stats["corruptions_injected"] == 1 and stats["checksums_verified"] == 0
    assert not written(d, p, D_BLOCKS, P_BLOCKS)  # the flipped byte is in D's first block


def test_a_push_check_waits_for_p_sums_and_ends_unanswered_without_them(monkeypatch) -> None:
    monkeypatch.setattr(verify, "ANSWER_S", 0.2)
    exp = verify.Expected()
    assert exp.poll(lambda: [1], 0.0) == (False, None)  # not all written yet: no clock
    exp.start(10.0)
    assert exp.poll(lambda: [1], 10.1) == (False, None)
    ended, why = exp.poll(lambda: [1], 10.3)
    assert ended and why is not None and why.startswith("unanswered")
    early = verify.Expected()  # P's Sums may come before D saw every Wrote
    early.given(messages.Sums("t", 0, [5, 6]))
    assert early.poll(lambda: [5, 6], 0.0) == (True, None)
    assert early.poll(lambda: [5, 7], 0.0)[1] == "mismatch in 1 of 2 blocks (first at [1])"
    failed = verify.Expected()
    failed.given(messages.Sums("t", 0, error="RuntimeError: no view"))
    assert failed.poll(lambda: [5], 0.0) == (True, "unanswered: RuntimeError: no view")


def _push(engines, mode: str):
    p = engines("P", seed=13, kv_checksums=mode)
    d = engines("D", kv_checksums=mode)
    d_register(d, p, "d-req", "t1", D_BLOCKS)
    p_done(p, "p-req", "t1", P_BLOCKS)
    return p, d


def test_a_checked_push_delivers_the_kv_and_frees_p(engines) -> None:
    p, d = _push(engines, "all")
    got = d.collect(lambda r: "d-req" in r.recvd, 10)
    assert got.bad_blocks == set() and written(d, p, D_BLOCKS, P_BLOCKS)
    stats = d.worker.stats.snapshot()
    assert stats["checksums_verified"] == 1 and stats["push_received"] == 1
    assert stats["checksum_mismatches"] == 0 and stats["checksums_unanswered"] == 0
    assert p.collect(lambda r: "p-req" in r.sent, 10).sent == {"p-req"}
    assert d.worker.push_recv.num_tracked == 0 and p.worker.push_write.num_tracked == 0


def test_a_corrupted_push_is_caught_recomputed_and_p_still_freed(engines, hooks) -> None:
    hooks([{"point": "corrupt", "action": "flip", "p": 1.0}])
    p, d = _push(engines, "all")
    got = d.collect(lambda r: "d-req" in r.recvd, 10)
    assert got.bad_blocks == set(D_BLOCKS)  # vLLM recomputes these
    stats = d.worker.stats.snapshot()
    assert (stats["corruptions_injected"], stats["checksum_mismatches"]) == (1, 1)
    assert stats["checksums_verified"] == 0 and stats["push_received"] == 0
    (why,) = [e.detail for e in stats.events if e.name == "checksum_mismatches"]
    assert why.startswith("mismatch in 1 of 6 blocks"), why
    assert p.collect(lambda r: "p-req" in r.sent, 10).sent == {"p-req"}
    assert d.worker.push_recv.num_tracked == 0


def test_an_unchecked_push_lets_the_same_flip_through(engines, hooks) -> None:
    """What the push check is for: the flip really changes the KV D would decode."""
    hooks([{"point": "corrupt", "action": "flip", "p": 1.0}])
    p, d = _push(engines, "off")
    got = d.collect(lambda r: "d-req" in r.recvd, 10)
    assert got.bad_blocks == set()
    stats = d.worker.stats.snapshot()
    assert stats["corruptions_injected"] == 1 and stats["checksums_verified"] == 0
    assert not written(d, p, D_BLOCKS, P_BLOCKS)
