"""Early push: P's WRITE starts when the forward that completes a prompt is done.

Scheduler planning is pure; the worker side runs two in-process TransferWorkers over real
NIXL (tests/helpers_workers.py). The fence stands in for a CUDA event (FakeFence).
"""

from __future__ import annotations

import threading

import helpers_workers
import pytest
from helpers_workers import (
    D_BLOCKS,
    P_BLOCKS,
    PROMPT,
    Engine,
    blocks_of,
    d_register,
    failures,
    settle,
    written,
)

from kvferry.connectors.protocol.step import StepMeta
from kvferry.connectors.scheduling.scheduler import TransferScheduler

engines = helpers_workers.engines
pytestmark = pytest.mark.timeout(60)

BS = 4
PUSH = {"do_remote_decode": True, "push": True, "transfer_id": "t1"}


def sched(early: bool = True) -> TransferScheduler:
    return TransferScheduler("P0", "127.0.0.1", 5600, BS, early_push=early)


def last_chunk(s: TransferScheduler, req: str = "p1", blocks=P_BLOCKS) -> StepMeta:
    s.track_push_prefill(req, PROMPT, PUSH, 1)
    s.after_alloc(req, blocks, 0, PUSH)
    s.plan_push({req: (0, len(PROMPT))}, {}, set())
    return s.take_meta()


# -- scheduler ------------------------------------------------------------------------


def test_single_chunk_prefill_is_ready_in_its_own_step() -> None:
    s = sched()
    meta = last_chunk(s)
    [r] = meta.push_ready
    assert (r.req_id, r.transfer_id, r.block_ids, r.num_tokens) == ("p1", "t1", P_BLOCKS, 22)
    assert s.pushed_early == {"p1": "t1"}
    keep, out = s.finished("p1", True, P_BLOCKS, PUSH, PROMPT)
    assert keep and out["transfer_id"] == "t1"
    assert [p.req_id for p in s.take_meta().push_send] == ["p1"]  # duplicate, harmless
    assert not s.tracks_push()


def test_chunked_prefill_waits_for_the_last_chunk_with_every_block() -> None:
    s = sched()
    s.track_push_prefill("p1", PROMPT, PUSH, 1)
    s.after_alloc("p1", P_BLOCKS[:3], 0, PUSH)
    s.plan_push({"p1": (0, 12)}, {}, set())
    assert s.take_meta().push_ready == []
    s.plan_push({"p1": (12, 10)}, {"p1": (P_BLOCKS[3:], False)}, set())
    [r] = s.take_meta().push_ready
    assert r.block_ids == P_BLOCKS


@pytest.mark.parametrize("case", ["two_tokens", "not_push", "disabled", "no_tid"])
def test_only_single_token_push_prefills_are_tracked(case: str) -> None:
    s = sched(early=case != "disabled")
    params = {k: v for k, v in PUSH.items() if not (case == "not_push" and k == "push")}
    if case == "no_tid":
        params["transfer_id"] = ""
    s.track_push_prefill("p1", PROMPT, params, 2 if case == "two_tokens" else 1)
    s.after_alloc("p1", P_BLOCKS, 0, params)
    s.plan_push({"p1": (0, len(PROMPT))}, {}, set())
    assert s.take_meta().push_ready == [] and not s.tracks_push()


def test_preempted_before_its_last_chunk_pushes_the_normal_way() -> None:
    s = sched()
    s.track_push_prefill("p1", PROMPT, PUSH, 1)
    s.after_alloc("p1", P_BLOCKS[:3], 0, PUSH)
    s.plan_push({"p1": (0, 12)}, {}, set())
    s.plan_push({}, {}, {"p1"})
    s.track_push_prefill("p1", PROMPT, PUSH, 1)  # rescheduled: not tracked again
    s.plan_push({"p1": (0, 22)}, {"p1": (P_BLOCKS, True)}, set())
    meta = s.take_meta()
    assert meta.push_ready == [] and meta.push_preempted == []
    assert s.finished("p1", True, P_BLOCKS, PUSH, PROMPT)[0]


def test_preempted_after_the_early_push_is_reported_and_finish_is_normal() -> None:
    s = sched()
    last_chunk(s)
    s.plan_push({}, {}, {"p1"})
    assert s.take_meta().push_preempted == [("t1", "p1")]
    assert s.pushed_early == {}
    keep, _ = s.finished("p1", True, P_BLOCKS, PUSH, PROMPT)
    assert keep and s.take_meta().push_send[0].req_id == "p1"


def test_abort_after_an_early_push_keeps_the_blocks_for_the_worker() -> None:
    s = sched()
    last_chunk(s)
    keep, out = s.finished("p1", False, P_BLOCKS, PUSH, PROMPT)
    assert (keep, out) == (True, None) and "p1" in s.waiting_send
    assert s.take_meta().push_abort_p == [("t1", "p1")]
    # without an early push the abort frees at once, as before
    s2 = sched(early=False)
    s2.track_push_prefill("p1", PROMPT, PUSH, 1)
    assert s2.finished("p1", False, P_BLOCKS, PUSH, PROMPT) == (False, None)


# -- worker: real NIXL between two in-process workers --------------------------------


class FakeFence:
    """Stands in for torch.cuda.Event: query() is True once the 'device' is done."""

    def __init__(self) -> None:
        self.passed = threading.Event()

    def query(self) -> bool:
        return self.passed.is_set()


def early_p(engines, seed: int) -> Engine:
    p = engines("P", seed=seed)
    p.sched = TransferScheduler(p.engine_id, "127.0.0.1", p.port, BS, early_push=True)
    return p


def forward(p: Engine, step: int, fence=None) -> StepMeta:
    """Engine step ``step`` computes the prompt's last chunk (meta, forward, fence)."""
    meta = last_chunk(p.sched)
    p.worker.submit(meta, step)
    p.worker.forward_done(meta.push_ready, fence, step)
    return meta


def finish(p: Engine, ok: bool, step: int) -> bool:
    keep, _ = p.sched.finished("p1", ok, P_BLOCKS, PUSH, PROMPT)
    p.worker.submit(p.sched.take_meta(), step)
    return keep


def test_write_waits_for_fence_and_next_step_and_free_waits_for_finish(engines) -> None:
    p, d = early_p(engines, 21), engines("D")
    d_register(d, p, "d1", "t1", D_BLOCKS)
    fence = FakeFence()
    forward(p, 1, fence)
    p.worker.submit(StepMeta(), 2)  # the next step began, but the device is not done
    assert "d1" not in d.collect(lambda r: "d1" in r.recvd, 0.4).recvd
    fence.passed.set()
    assert d.collect(lambda r: "d1" in r.recvd, 15).bad_blocks == set(), failures(p, d)
    assert written(d, p, D_BLOCKS, P_BLOCKS)
    # Written before P's scheduler finished the request: vLLM must not free it yet.
    assert "p1" not in settle(p, 0.3).sent
    assert finish(p, True, 3)
    assert p.collect(lambda r: "p1" in r.sent, 10).sent == {"p1"}
    assert p.worker.push_write.num_tracked == 0 and p.worker.push_write.num_unfinished == 0


def test_write_waits_for_the_next_step_to_begin(engines) -> None:
    p, d = early_p(engines, 22), engines("D")
    d_register(d, p, "d1", "t1", D_BLOCKS)
    forward(p, 1)  # fence None: complete, but step 2 may still preempt the request
    assert "d1" not in d.collect(lambda r: "d1" in r.recvd, 0.4).recvd
    p.worker.submit(StepMeta(), 2)
    assert d.collect(lambda r: "d1" in r.recvd, 15).bad_blocks == set(), failures(p, d)
    assert written(d, p, D_BLOCKS, P_BLOCKS)


def test_preemption_in_the_next_step_cancels_the_write_and_reports_no_free(engines) -> None:
    p, d = early_p(engines, 23), engines("D")
    d_register(d, p, "d1", "t1", D_BLOCKS)
    before = [t.clone() for t in blocks_of(d.kv, D_BLOCKS)]
    forward(p, 1)
    p.sched.plan_push({}, {}, {"p1"})  # step 2's schedule preempted p1: vLLM freed its blocks
    p.worker.submit(p.sched.take_meta(), 2)
    got = d.collect(lambda r: "d1" in r.recvd, 10)  # P rejects: D recomputes
    assert set(D_BLOCKS) <= got.bad_blocks
    assert "p1" not in settle(p, 0.3).sent
    assert not written(d, p, D_BLOCKS, P_BLOCKS)
    assert all(a.equal(b) for a, b in zip(before, blocks_of(d.kv, D_BLOCKS),
                                          strict=True))
    # Resumed and finished later: P frees its (new) blocks; nothing is written.
    assert finish(p, True, 3)
    assert p.collect(lambda r: "p1" in r.sent, 10).sent == {"p1"}


def test_abort_before_the_fence_frees_at_once_and_rejects_d(engines) -> None:
    p, d = early_p(engines, 24), engines("D")
    d_register(d, p, "d1", "t1", D_BLOCKS)
    fence = FakeFence()
    forward(p, 1, fence)
    assert finish(p, False, 2)  # client went away: blocks held for the worker
    assert p.collect(lambda r: "p1" in r.sent, 10).sent == {"p1"}
    assert set(D_BLOCKS) <= d.collect(lambda r: "d1" in r.recvd, 10).bad_blocks
    fence.passed.set()
    settle(p, 0.3)
    assert p.worker.push_write.matcher.num_live == 0 and p.worker.push_write.num_tracked == 0


def test_finish_before_release_takes_the_normal_path_without_leaks(engines) -> None:
    """CPU engines without async scheduling: the step after the forward already carries
    the scheduler's push_send; the early item is dropped, the normal path writes once."""
    p, d = early_p(engines, 25), engines("D")
    d_register(d, p, "d1", "t1", D_BLOCKS)
    forward(p, 1)
    assert finish(p, True, 2)
    assert d.collect(lambda r: "d1" in r.recvd, 15).bad_blocks == set(), failures(p, d)
    assert written(d, p, D_BLOCKS, P_BLOCKS)
    assert p.collect(lambda r: "p1" in r.sent, 10).sent == {"p1"}
    assert p.worker.push_write.num_unfinished == 0 and p.worker.push_write.num_tracked == 0
