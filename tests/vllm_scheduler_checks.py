"""kvferry against one vLLM version's real Scheduler (run by test_vllm_versions.py): pull
handoff, failed reads recomputed, early push over chunked prefill, push registration,
leases yielding to running and waiting requests, and the worker-side glue; the tests stand in for
the model runner with the outputs it would return.

test_vllm_versions.py starts pytest on these files once per supported version, with the
version's sources (fetched by .ci/setup) first on PYTHONPATH, so every vLLM object here is
that version's own. No engine starts and no compiled vLLM extension is needed."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import helpers_vllm_api
from helpers_vllm_api import (
    NUM_BLOCKS,
    PROMPT,
    VERSION,
    blocks_of,
    free_blocks,
    kv_cache_config,
    request,
    step,
    vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import base
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from kvferry.connectors.connector import KvferryConnector

_secret = helpers_vllm_api._secret
tiny = helpers_vllm_api.tiny
make = helpers_vllm_api.make


# -- the scheduler side, driven by this version's own Scheduler ---------------------------------
def _prefill_on_p(P: Scheduler) -> dict:
    """P computes PROMPT for D (max_tokens 1) and answers with its signed offer."""
    P.add_request(request("p1", PROMPT, 1, {"do_remote_decode": True}))
    so, outs = step(P)
    assert dict(so.num_scheduled_tokens) == {"p1": len(PROMPT)}
    (out,) = outs
    assert out.finish_reason is not None and out.kv_transfer_params is not None
    offer = out.kv_transfer_params
    assert offer["remote_block_ids"][:3] == blocks_of(P, "p1")[:3]  # P still holds them
    assert offer["remote_num_tokens"] == len(PROMPT) and offer["remote_engine_id"] == "P"
    return offer


def test_pull_handoff_through_the_real_scheduler(make):
    P, D = make("P"), make("D")
    offer = _prefill_on_p(P)
    held = free_blocks(P)
    assert held == NUM_BLOCKS - 1 - 3  # the finished prefill's 3 blocks wait for D's READ

    D.add_request(request("d1", PROMPT, 3, dict(offer, do_remote_prefill=True)))
    so, _ = step(D)
    assert dict(so.num_scheduled_tokens) == {}
    assert D.requests["d1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (task,) = so.kv_connector_metadata.step.recv
    assert task.local_block_ids == blocks_of(D, "d1")[:3]
    assert task.remote_block_ids == offer["remote_block_ids"][:3]

    step(D, KVConnectorOutput(finished_recving={"d1"}))  # D's transfer thread: READ done
    so, _ = step(D)
    assert dict(so.num_scheduled_tokens) == {"d1": 1}  # D computes the last token only
    assert D.requests["d1"].status == RequestStatus.RUNNING

    step(P)  # the step after the prefill finished; then, with only p1 waiting for D:
    assert P.has_requests() is (VERSION >= (0, 24))  # 0.21's engine stops stepping here
    so, _ = step(P, KVConnectorOutput(finished_sending={"p1"}))  # P's thread: D has read
    assert free_blocks(P) == NUM_BLOCKS - 1 and "p1" not in P.requests
    assert not P.connector._sched.waiting_send


def test_failed_read_recomputes_the_prompt(make):
    P, D = make("P"), make("D")
    offer = _prefill_on_p(P)
    D.add_request(request("d1", PROMPT, 3, dict(offer, do_remote_prefill=True)))
    so, _ = step(D)
    (task,) = so.kv_connector_metadata.step.recv
    # the READ failed: the worker reports the request done and its first block invalid
    step(D, KVConnectorOutput(finished_recving={"d1"}, invalid_block_ids={task.local_block_ids[0]}))
    so, _ = step(D)
    assert dict(so.num_scheduled_tokens) == {"d1": len(PROMPT)}  # recomputed from block 0


def test_early_push_follows_chunked_prefill_blocks(make):
    """P's early push learns the blocks of a prompt prefilled in chunks from what the
    scheduler reports each step (compat.step_progress / grown_blocks on this version's
    SchedulerOutput): the WRITE handed over with the last chunk names them all."""
    P = make("P", max_batched=32)
    prompt = list(range(1, 101))  # 100 tokens: 7 blocks, scheduled 32 at a time
    P.add_request(request("p1", prompt, 1, {"do_remote_decode": True, "push": True,
                                             "transfer_id": "t1"}))
    ready, steps = [], 0
    while not ready:
        so, outs = step(P)
        steps += 1
        ready = so.kv_connector_metadata.step.push_ready
        assert steps < 6
    assert steps == 4 and sum(so.num_scheduled_tokens.values()) == 100 - 96
    (push,) = ready
    assert push.transfer_id == "t1" and push.num_tokens == 100
    assert push.block_ids == blocks_of(P, "p1")[:7]
    assert outs and outs[0].kv_transfer_params == {"transfer_id": "t1", "push": True}


def test_push_decode_registers_its_blocks(make):
    D = make("D")
    D.add_request(request("d1", PROMPT, 3, {"do_remote_prefill": True, "push": True,
                                             "transfer_id": "t1", "remote_host": "127.0.0.1",
                                             "remote_port": 5600}))
    so, _ = step(D)
    (reg,) = so.kv_connector_metadata.step.register
    assert reg.transfer_id == "t1" and reg.block_ids == blocks_of(D, "d1")[:3]
    assert reg.num_tokens == len(PROMPT) and reg.first_token == 0
    step(D, KVConnectorOutput(finished_recving={"d1"}))  # P's WRITE landed
    so, _ = step(D)
    assert dict(so.num_scheduled_tokens) == {"d1": 1}


LEASE_TIMING = {"reuse_read_timeout_s": 0.02, "lease_margin_s": 1.0, "lease_free_grace_s": 0.05}


def test_leases_yield_to_running_requests_where_vllm_asks(make):
    """D keeps a finished turn's blocks under a lease. When a running request needs a
    block and none is free, 0.32+ asks the connector before preempting
    (has_pending_block_frees) and the lease yields; older versions never ask: they
    preempt, and the lease then yields to the preempted request waiting first."""
    D = make("D", dict(LEASE_TIMING, lease_free_watermark=0), num_blocks=8)  # 7 usable;
    # no reserve: only vLLM's question can make the lease yield here
    D.add_request(request("d1", PROMPT, 2, {"lease": {"lease_id": "L1"}}))
    outs: list = []
    while not outs or outs[-1].finish_reason is None:
        _, outs = step(D)
    lease = outs[-1].kv_transfer_params["lease"]
    assert lease["lease_id"] == "L1" and lease["block_ids"] == blocks_of(D, "d1")[:2]
    assert "d1" in D.requests and free_blocks(D) == 7 - 3  # kept for the next turn's P

    D.add_request(request("d2", list(range(100, 164)), 3, None))  # 64 tokens: the 4 free
    so, _ = step(D)
    assert dict(so.num_scheduled_tokens) == {"d2": 64} and free_blocks(D) == 0
    so, _ = step(D)  # d2's next token needs a fifth block
    assert dict(so.num_scheduled_tokens) == {}
    held = D.connector._sched.leases.table  # "in": still held (a release frees at once)
    if VERSION < (0, 32):
        assert D.requests["d2"].status == RequestStatus.PREEMPTED  # nobody asked kvferry;
        assert "L1" not in held  # the preempted request now waits first: the lease yields
        return  # (the reserve, test_a_lease_yields_to_the_reserve..., avoids the preemption)
    assert D.requests["d2"].status == RequestStatus.RUNNING  # not preempted:
    assert "L1" not in held  # vLLM asked; kvferry released the least recently used lease
    # No P was told L1 held (no READ can run): its blocks go to the worker in this step;
    # the worker frees them, then reports it.
    assert so.kv_connector_metadata.step.free == ["d1"]
    step(D, KVConnectorOutput(finished_sending={"d1"}))
    so, _ = step(D)
    assert dict(so.num_scheduled_tokens) == {"d2": 1}


def _leased_turn(D: Scheduler) -> None:
    """d1 (3 blocks) finishes under lease L1: 4 of 7 usable blocks stay free."""
    D.add_request(request("d1", PROMPT, 2, {"lease": {"lease_id": "L1"}}))
    outs: list = []
    while not outs or outs[-1].finish_reason is None:
        _, outs = step(D)
    assert "L1" in D.connector._sched.leases.table and free_blocks(D) == 4


def _lease_freed(D: Scheduler, so: Any, p_checked: bool) -> None:
    """d1's lease just ended in step ``so``: its blocks go to the worker in that step when
    no P was told the lease held, else a grace after that answer (a READ may run till
    then); the worker frees them and reports it."""
    if p_checked:
        assert so.kv_connector_metadata.step.free == []
        time.sleep(LEASE_TIMING["lease_free_grace_s"] * 3)
        so, _ = step(D)
    assert so.kv_connector_metadata.step.free == ["d1"]
    step(D, KVConnectorOutput(finished_sending={"d1"}))


def test_a_lease_yields_before_a_new_request_waits_for_blocks(make):
    """No version asks the connector when a new request cannot get blocks; kvferry reads
    the Scheduler's free blocks and waiting queue every step (`compat.kv_pressure`) and
    releases the least recently used lease the first waiting request needs."""
    _yield_to_waiting(make, p_checked=False)


def test_a_lease_p_was_told_held_yields_a_grace_later(make):
    """As above, but a P about to READ was told the lease held: the blocks wait out
    that READ (the grace), then go to the waiting request."""
    _yield_to_waiting(make, p_checked=True)


def _yield_to_waiting(make: Any, p_checked: bool) -> None:
    D = make("D", dict(LEASE_TIMING, lease_free_watermark=0), num_blocks=8)
    _leased_turn(D)
    keeper = D.connector._sched.leases
    if p_checked:
        keeper.info("L1", for_read=True)  # a P about to READ asked that L1 holds
    D.add_request(request("d2", list(range(100, 180)), 2, None))  # 80 tokens: 6 blocks
    so, _ = step(D)
    assert dict(so.num_scheduled_tokens) == {} and D.requests["d2"].status == RequestStatus.WAITING
    assert "L1" not in keeper.table and keeper.released_for_pressure == 1
    _lease_freed(D, so, p_checked)
    so, _ = step(D)
    assert dict(so.num_scheduled_tokens) == {"d2": 80}
    assert keeper.released_for_pressure == 1


def test_a_lease_yields_to_the_reserve_before_anything_is_preempted(make):
    """Below the free-block watermark (here half the cache) D releases leases at once, so
    their blocks are free (after the grace) before a running request needs them: no
    preemption on any version, also those that never ask `has_pending_block_frees`."""
    D = make("D", dict(LEASE_TIMING, lease_free_watermark=0.5), num_blocks=8)
    _leased_turn(D)  # 4 free of 8: at the reserve, nothing released
    keeper = D.connector._sched.leases
    assert keeper.released_for_pressure == 0
    D.add_request(request("d2", list(range(100, 164)), 3, None))  # 64 tokens: the 4 free
    so, _ = step(D)
    assert dict(so.num_scheduled_tokens) == {"d2": 64} and free_blocks(D) == 0
    assert "L1" not in keeper.table and keeper.released_for_pressure == 1
    _lease_freed(D, so, p_checked=False)
    so, _ = step(D)  # d2's next token takes a block d1 held
    assert dict(so.num_scheduled_tokens) == {"d2": 1}
    assert D.requests["d2"].status == RequestStatus.RUNNING


def test_worker_side_glue_on_this_base_class(tiny):
    """The base-class state kvferry's worker side reads, and the calls vLLM's model runner
    makes around a step (0.32+: get_transfer_results wraps get_finished)."""
    from kvferry.connectors.connector import KvferryMeta
    from kvferry.connectors.scheduling.scheduler import StepMeta

    vc, kvc = vllm_config(tiny), kv_cache_config()
    c = KvferryConnector(vc, base.KVConnectorRole.WORKER, kvc)
    assert c._vllm_config is vc and c._kv_cache_config is kvc
    assert c._kv_transfer_config is vc.kv_transfer_config and c.role == base.KVConnectorRole.WORKER
    meta = KvferryMeta(StepMeta(idle=True))
    c.bind_connector_metadata(meta)
    assert c._connector_metadata is meta
    c.start_load_kv(SimpleNamespace())  # no KV registered yet: nothing to submit
    c.wait_for_save()
    assert c.get_finished(set()) == (None, None)
    if hasattr(base.KVConnectorBase_V1, "get_transfer_results"):
        res = c.get_transfer_results(set())
        assert (res.finished_sending, res.finished_recving) == (set(), set())
    assert c.get_block_ids_with_load_errors() == set()
    c.clear_connector_metadata()
    assert c._connector_metadata is None
    c.shutdown()
