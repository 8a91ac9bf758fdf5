"""Push glue (connectors/transfer/push_recv.py, push_write.py): two in-process TransferWorkers over real NIXL.

The scheduler builds the step metadata exactly as in an engine; the workers register,
WRITE and notify for real. Focus: transfer ids that are replayed or shared, whose
requests must be refused without touching the legitimate transfer or leaking blocks.
"""

from __future__ import annotations

import time

import helpers_workers
import pytest
import torch
from helpers_workers import (
    D_BLOCKS,
    P_BLOCKS,
    PROMPT,
    blocks_of,
    d_register,
    d_task,
    p_done,
    p_finish,
    settle,
    written,
)

engines = helpers_workers.engines  # in-process P and D workers over real NIXL

pytestmark = pytest.mark.timeout(60)


def test_push_write_lands_and_both_sides_finish(engines):
    p, d = engines("P", seed=11), engines("D")
    d_register(d, p, "d1", "t1", D_BLOCKS)
    p_done(p, "p1", "t1", P_BLOCKS)
    assert d.collect(lambda r: "d1" in r.recvd, 15).bad_blocks == set()
    assert written(d, p, D_BLOCKS, P_BLOCKS)
    assert p.collect(lambda r: "p1" in r.sent, 10).sent == {"p1"}
    assert p.worker.push_write.num_tracked == 0 and d.worker.push_recv.num_tracked == 0


def test_replaying_a_completed_transfer_id_on_p_frees_the_new_request(engines):
    p, d = engines("P", seed=12), engines("D")
    d_register(d, p, "d1", "t1", D_BLOCKS)
    p_done(p, "p1", "t1", P_BLOCKS)
    assert d.collect(lambda r: "d1" in r.recvd, 15).bad_blocks == set()
    p.collect(lambda r: "p1" in r.sent, 10)
    before = [t.clone() for t in blocks_of(d.kv, D_BLOCKS)]
    # The same transfer id again (a client replaying parameters): P frees it at once and
    # never writes into D's (by now reused) blocks.
    p_done(p, "p2", "t1", [0, 1, 5, 6, 7, 8])
    assert p.collect(lambda r: "p2" in r.sent, 10).sent == {"p1", "p2"}
    settle(d)
    assert all(torch.equal(a, b) for a, b in zip(before, blocks_of(d.kv, D_BLOCKS), strict=True))
    assert p.worker.push_write.num_tracked == 0


def test_second_p_request_with_a_live_transfer_id_is_refused_first_is_served(engines):
    p, d = engines("P", seed=13), engines("D")
    p_done(p, "p1", "t1", P_BLOCKS)
    p_done(p, "p2", "t1", [0, 1, 5, 6, 7, 8])
    assert p.collect(lambda r: "p2" in r.sent, 10).sent == {"p2"}  # refused, freed at once
    d_register(d, p, "d1", "t1", D_BLOCKS)
    assert d.collect(lambda r: "d1" in r.recvd, 15).bad_blocks == set()
    assert written(d, p, D_BLOCKS, P_BLOCKS)  # the first request's KV, not the second's
    assert p.collect(lambda r: "p1" in r.sent, 10).sent == {"p1", "p2"}


def test_two_d_requests_with_one_transfer_id_never_hang(engines):
    p, d = engines("P", seed=14), engines("D")
    d_register(d, p, "d1", "t1", D_BLOCKS)
    other = [4, 5, 6, 9, 10, 11]
    d_register(d, p, "d2", "t1", other)
    got = d.collect(lambda r: "d2" in r.recvd, 5)
    assert "d2" in got.recvd and set(other) <= got.bad_blocks  # recomputes at once
    p_done(p, "p1", "t1", P_BLOCKS)
    d.collect(lambda r: "d1" in r.recvd, 15)
    assert written(d, p, D_BLOCKS, P_BLOCKS)
    assert not set(D_BLOCKS) & d.acc.bad_blocks


def test_registration_then_p_abort_leaves_no_state(engines):
    p, d = engines("P", seed=15), engines("D")
    d_register(d, p, "d1", "t1", D_BLOCKS)
    deadline = time.monotonic() + 10
    while p.worker.push_write.matcher.state("t1") != "waiting_prefill":
        assert time.monotonic() < deadline, "registration never reached P"
        time.sleep(0.01)
    # P's request is cancelled before its prefill finished.
    keep, _ = p.sched.finished("p1", False, [], {"do_remote_decode": True, "push": True,
                                                 "transfer_id": "t1"}, PROMPT)
    assert not keep
    p.worker.submit(p.sched.take_meta())
    got = d.collect(lambda r: "d1" in r.recvd, 10)  # P's Reject: D recomputes at once
    assert set(D_BLOCKS) <= got.bad_blocks
    settle(p)
    assert p.worker.push_write.num_tracked == 0 and p.worker.push_write.matcher.num_live == 0
    assert d.worker.push_recv.num_tracked == 0


def test_p_abort_of_a_refused_duplicate_does_not_end_the_real_transfer(engines):
    p, d = engines("P", seed=16), engines("D")
    p_done(p, "p1", "t1", P_BLOCKS)
    keep, _ = p.sched.finished("p2", False, [], {"do_remote_decode": True, "push": True,
                                                 "transfer_id": "t1"}, PROMPT)
    p.worker.submit(p.sched.take_meta())
    settle(p, 0.3)
    assert p.worker.push_write.matcher.state("t1") == "holding"
    d_register(d, p, "d1", "t1", D_BLOCKS)
    assert d.collect(lambda r: "d1" in r.recvd, 15).bad_blocks == set()
    assert written(d, p, D_BLOCKS, P_BLOCKS)



def test_push_then_pull_from_one_p_loads_its_agent_once(engines, monkeypatch):
    """D met P by address (push registration), then by engine id (a pull offer): one NIXL
    remote agent, or the second load would invalidate transfers in flight to it (seen on
    H200 as NIXL_ERR_NOT_FOUND and READs stuck for seconds)."""
    p, d = engines("P", seed=17), engines("D")
    loads: list[bytes] = []
    real = d.worker.transport.agent.add_remote_agent
    monkeypatch.setattr(d.worker.transport.agent, "add_remote_agent",
                        lambda md: loads.append(md) or real(md))
    d_register(d, p, "d1", "t1", D_BLOCKS)
    p_done(p, "p1", "t1", P_BLOCKS)
    assert d.collect(lambda r: "d1" in r.recvd, 15).bad_blocks == set()
    offer = p_finish(p, "p2", P_BLOCKS)
    p.worker.submit(p.sched.take_meta())
    d.worker.submit(d_task(d, "d2", offer, [9, 10, 11, 12, 13, 14]))
    assert d.collect(lambda r: "d2" in r.recvd, 15).bad_blocks == set()
    assert written(d, p, [9, 10, 11, 12, 13, 14], P_BLOCKS)
    assert len(loads) == 1
    peers = d.worker.transport.known_peers()
    assert len({id(x) for x in peers.values()}) == 1 and len(peers) == 2
    d.worker.peers.drop("127.0.0.1", p.port)  # dropped under one key: gone under both
    assert d.worker.transport.known_peers() == {}
