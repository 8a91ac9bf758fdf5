"""TransferWorker (connectors/transfer/worker.py): two in-process workers over real NIXL,
DRAM tensors (tests/helpers_workers.py), on the pull path minus vLLM."""

from __future__ import annotations

import time

import helpers_workers
import pytest
import torch
from helpers_http import free_port
from helpers_workers import BS, D_BLOCKS, P_BLOCKS, PROMPT, N, blocks_of, d_task, p_finish

from kvferry.connectors.config import ConnectorConfig
from kvferry.connectors.protocol import messages
from kvferry.connectors.protocol.params import PROTOCOL_VERSION
from kvferry.connectors.protocol.step import RecvTask, StepMeta
from kvferry.connectors.scheduling.scheduler import TransferScheduler
from kvferry.connectors.transfer.handshake import HandshakeServer

engines = helpers_workers.engines  # in-process P and D workers over real NIXL
pytestmark = pytest.mark.timeout(60)


def test_pull_read_delivers_bytes_and_frees_p_blocks(engines):
    p, d = engines("P", seed=1), engines("D")
    offer = p_finish(p, "p-req", P_BLOCKS)
    p.worker.submit(p.sched.take_meta())
    meta = d_task(d, "d-req", offer, D_BLOCKS)
    (task,) = meta.recv
    assert not task.release_only and task.remote_block_ids == P_BLOCKS
    d.worker.submit(meta)
    got = d.collect(lambda r: "d-req" in r.recvd, 15)
    assert got.recvd == {"d-req"} and got.bad_blocks == set()
    for mine, theirs in zip(blocks_of(d.kv, D_BLOCKS), blocks_of(p.kv, P_BLOCKS), strict=True):
        assert torch.equal(mine, theirs)
    others = [b for b in range(N) if b not in D_BLOCKS]
    assert not any(t.any() for t in blocks_of(d.kv, others))
    # P frees only after D's READ completed (its notification), well before the send timeout
    assert p.collect(lambda r: "p-req" in r.sent, 10).sent == {"p-req"}
    p.sched.worker_done(p.acc.sent)
    assert p.sched.waiting_send == set()


def test_second_read_reuses_the_handshake(engines):
    p, d = engines("P", seed=2), engines("D")
    for i, (pb, db) in enumerate([([0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15]),
                                  ([6, 7, 8, 9, 10, 11], [0, 1, 2, 3, 4, 5])]):
        offer = p_finish(p, f"p{i}", pb)
        p.worker.submit(p.sched.take_meta())
        d.worker.submit(d_task(d, f"d{i}", offer, db))
        assert d.collect(lambda r, i=i: f"d{i}" in r.recvd, 15).bad_blocks == set()
        assert all(torch.equal(a, b) for a, b in zip(blocks_of(d.kv, db), blocks_of(p.kv, pb),
                                                     strict=True))
        assert f"p{i}" in p.collect(lambda r, i=i: f"p{i}" in r.sent, 10).sent
    assert d.worker.transport.peer(f"{p.engine_id}/0") is not None


def test_local_prefix_hit_reads_only_the_rest(engines):
    p, d = engines("P", seed=3), engines("D")
    offer = p_finish(p, "p-req", P_BLOCKS)
    p.worker.submit(p.sched.take_meta())
    meta = d_task(d, "d-req", offer, D_BLOCKS, hit=2 * BS)
    assert meta.recv[0].local_block_ids == D_BLOCKS[2:]
    d.worker.submit(meta)
    assert d.collect(lambda r: "d-req" in r.recvd, 15).bad_blocks == set()
    assert not any(t.any() for t in blocks_of(d.kv, D_BLOCKS[:2]))  # the local hit is not overwritten
    for mine, theirs in zip(blocks_of(d.kv, D_BLOCKS[2:]), blocks_of(p.kv, P_BLOCKS[2:]), strict=True):
        assert torch.equal(mine, theirs)
    assert p.collect(lambda r: "p-req" in r.sent, 10).sent == {"p-req"}


def test_read_completing_before_p_registers_the_send_frees_on_registration(engines):
    p, d = engines("P", seed=4), engines("D")
    offer = p_finish(p, "p-req", P_BLOCKS)
    d.worker.submit(d_task(d, "d-req", offer, D_BLOCKS))
    assert d.collect(lambda r: "d-req" in r.recvd, 15).bad_blocks == set()
    time.sleep(0.2)  # P's thread has seen the notification, no send registered yet
    assert p.collect(lambda r: bool(r.sent), 0).sent == set()
    p.worker.submit(p.sched.take_meta())
    assert p.collect(lambda r: "p-req" in r.sent, 5).sent == {"p-req"}


def test_release_only_task_frees_p_without_reading(engines):
    p, d = engines("P", seed=5), engines("D")
    offer = p_finish(p, "p-req", P_BLOCKS)
    p.worker.submit(p.sched.take_meta())
    meta = d_task(d, "d-req", offer, D_BLOCKS, hit=len(PROMPT))  # full local hit
    assert meta.recv[0].release_only
    d.worker.submit(meta)
    assert p.collect(lambda r: "p-req" in r.sent, 10).sent == {"p-req"}
    got = d.collect(lambda r: False, 0.2)
    assert got.recvd == set() and got.bad_blocks == set()  # nothing read, nothing to report
    assert not any(t.any() for t in d.kv.values())


def test_closed_handshake_port_fails_read_with_bad_blocks_within_timeout(engines):
    p, d = engines("P", seed=6), engines("D", handshake_timeout_s=0.5)
    p.sched.pull.port = free_port()  # the offer names a port nobody listens on
    offer = p_finish(p, "p-req", P_BLOCKS)
    d.worker.submit(d_task(d, "d-req", offer, D_BLOCKS))
    t0 = time.monotonic()
    got = d.collect(lambda r: "d-req" in r.recvd, 5)
    assert got.recvd == {"d-req"} and got.bad_blocks == set(D_BLOCKS)
    assert time.monotonic() - t0 < 0.5 + 1.5
    assert d.worker.transport.peer(f"{p.engine_id}/0") is None
    assert not any(t.any() for t in d.kv.values())


def test_offer_naming_another_engine_at_that_port_fails_with_bad_blocks(engines):
    p, d = engines("P", seed=7), engines("D")
    p.sched.pull.engine_id = "someone-else"
    offer = p_finish(p, "p-req", P_BLOCKS)
    d.worker.submit(d_task(d, "d-req", offer, D_BLOCKS))
    got = d.collect(lambda r: "d-req" in r.recvd, 5)
    assert got.bad_blocks == set(D_BLOCKS)
    assert not any(t.any() for t in d.kv.values())


def test_out_of_range_remote_blocks_fail_and_release_p(engines):
    p, d = engines("P", seed=8), engines("D")
    offer = p_finish(p, "p-req", [0, 1, 2, 3, 4, N + 3])  # signed, but beyond P's cache
    p.worker.submit(p.sched.take_meta())
    d.worker.submit(d_task(d, "d-req", offer, D_BLOCKS))
    got = d.collect(lambda r: "d-req" in r.recvd, 10)
    assert got.bad_blocks == set(D_BLOCKS)
    assert p.collect(lambda r: "p-req" in r.sent, 5).sent == {"p-req"}  # P told to free now


@pytest.mark.timing
def test_p_send_timeout_frees_blocks_nobody_reads(engines):
    p = engines("P", seed=9, send_timeout_s=0.6)
    p_finish(p, "p-req", P_BLOCKS)
    t0 = time.monotonic()
    p.worker.submit(p.sched.take_meta())
    assert p.collect(lambda r: bool(r.sent), 0.3).sent == set()  # still waiting for D
    assert p.collect(lambda r: "p-req" in r.sent, 5).sent == {"p-req"}
    assert 0.55 <= time.monotonic() - t0 < 2.0


def test_empty_step_meta_is_ignored(engines):
    p = engines("P")
    p.worker.submit(StepMeta())
    got = p.collect(lambda r: False, 0.1)
    assert (got.sent, got.recvd, got.bad_blocks) == (set(), set(), set())


def test_results_are_handed_over_once(engines):
    p = engines("P", send_timeout_s=0.1)
    p.worker.submit(StepMeta(send=["a"]))
    assert p.collect(lambda r: "a" in r.sent, 5).sent == {"a"}
    time.sleep(0.1)
    r = p.worker.results()
    assert r.sent == set() and r.recvd == set()


def test_unknown_notifications_do_not_free_other_requests(engines):
    p, d = engines("P", seed=10, send_timeout_s=30), engines("D")
    offer = p_finish(p, "p-req", P_BLOCKS)
    p.worker.submit(p.sched.take_meta())
    d.worker.submit(d_task(d, "d-req", offer, D_BLOCKS))
    d.collect(lambda r: "d-req" in r.recvd, 15)
    assert p.collect(lambda r: "p-req" in r.sent, 5).sent == {"p-req"}
    peer = d.worker.transport.peer(f"{p.engine_id}/0")
    d.worker.transport.notify(peer, messages.encode(messages.Done("other")))  # not waiting: must not report
    d.worker.transport.notify(peer, b"garbage")
    p.worker.submit(StepMeta(send=["third"]))
    assert p.collect(lambda r: False, 0.3).sent == {"p-req"}


def test_peer_of_another_protocol_version_is_refused_at_the_handshake(engines):
    """A P of another kvferry version answers the side channel with its version: D reads
    nothing from it (bad blocks: recompute) and still serves the next offer."""
    p, d = engines("P", seed=13), engines("D")
    other_port = free_port()
    other = HandshakeServer("127.0.0.1", other_port, {
        "engine_id": "other", "rank": 0, "metadata": p.worker.transport.metadata(),
        "layout": p.worker.transport.layout.to_wire(), "protocol": PROTOCOL_VERSION + 1})
    try:
        p.sched.pull.engine_id, p.sched.pull.port = "other", other_port
        offer = p_finish(p, "old", P_BLOCKS)
        d.worker.submit(d_task(d, "d-old", offer, D_BLOCKS))
        got = d.collect(lambda r: "d-old" in r.recvd, 5)
        assert got.recvd == {"d-old"} and got.bad_blocks == set(D_BLOCKS)
        assert d.worker.transport.peer("other/0") is None
    finally:
        other.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_bad_peer_metadata_fails_one_request_and_worker_keeps_serving(engines):
    p, d = engines("P", seed=11), engines("D", recv_timeout_s=5)
    bogus_port = free_port()
    bogus = HandshakeServer("127.0.0.1", bogus_port, {
        "engine_id": "bogus", "rank": 0, "metadata": b"not nixl metadata",
        "layout": d.worker.transport.layout.to_wire(), "protocol": PROTOCOL_VERSION})
    try:
        p.sched.pull.engine_id, p.sched.pull.port = "bogus", bogus_port
        bad = p_finish(p, "bad", P_BLOCKS)
        p.sched.pull.engine_id, p.sched.pull.port = p.engine_id, p.port
        d.worker.submit(d_task(d, "d-bad", bad, D_BLOCKS))
        got = d.collect(lambda r: "d-bad" in r.recvd, 3)
        assert got.recvd == {"d-bad"} and got.bad_blocks == set(D_BLOCKS)
        good = p_finish(p, "good", P_BLOCKS)
        d.worker.submit(d_task(d, "d-good", good, D_BLOCKS))
        assert "d-good" in d.collect(lambda r: "d-good" in r.recvd, 5).recvd
    finally:
        bogus.close()


def test_recv_task_dataclass_defaults():
    from kvferry.connectors.protocol.params import RemotePrefill

    o = RemotePrefill(remote_engine_id="e", remote_host="h", remote_port=1, remote_block_ids=[],
                      remote_request_id="r", remote_num_tokens=0, prompt_hash="")
    t = RecvTask("r", [], [], o)
    assert t.release_only is False


def test_expired_offer_is_never_read_and_p_is_released(engines):
    """P may free unread blocks after its send timeout; an offer past its signed expiry
    must never be read (those blocks may hold another request's KV by then)."""
    p, d = engines("P", seed=11), engines("D")
    p.sched = TransferScheduler(p.engine_id, "127.0.0.1", p.port, BS, offer_ttl=30.0,
                                clock=lambda: time.time() - 31.0)  # the prefill ended 31 s ago
    offer = p_finish(p, "p-req", P_BLOCKS)
    assert 0 < offer["expiry"] < time.time()
    p.worker.submit(p.sched.take_meta())
    d.worker.submit(d_task(d, "d-req", offer, D_BLOCKS))
    got = d.collect(lambda r: "d-req" in r.recvd, 5)
    assert got.bad_blocks == set(D_BLOCKS)  # recomputed
    assert not any(t.any() for t in d.kv.values())  # nothing was read
    assert p.collect(lambda r: "p-req" in r.sent, 5).sent == {"p-req"}  # P told to free


def test_live_offer_carries_its_expiry_and_reads(engines):
    p, d = engines("P", seed=12), engines("D")
    p.sched = TransferScheduler(p.engine_id, "127.0.0.1", p.port, BS, offer_ttl=30.0)
    offer = p_finish(p, "p-req", P_BLOCKS)
    assert time.time() + 25 < offer["expiry"] <= time.time() + 30
    p.worker.submit(p.sched.take_meta())
    d.worker.submit(d_task(d, "d-req", offer, D_BLOCKS))
    got = d.collect(lambda r: "d-req" in r.recvd, 10)
    assert got.recvd == {"d-req"} and got.bad_blocks == set()


def test_idle_step_waits_for_a_result_and_wakes_at_once(engines):
    """results(wait_s): an engine step with nothing to compute waits for the transfer
    thread instead of spinning, and returns as soon as something is reported."""
    import threading

    p = engines("P")
    t0 = time.monotonic()
    assert not p.worker.results(0.3).any()
    assert 0.25 <= time.monotonic() - t0 < 2.0
    threading.Timer(0.1, p.worker.out.report, kwargs={"recvd": {"r1"}}).start()
    t0 = time.monotonic()
    got = p.worker.results(5.0)
    assert got.recvd == {"r1"} and time.monotonic() - t0 < 1.0
    p.worker.out.report(sent={"r2"})
    t0 = time.monotonic()
    assert p.worker.results(5.0).sent == {"r2"} and time.monotonic() - t0 < 0.1


def test_notification_poll_follows_the_backend() -> None:
    """Awaited notifications are polled every 0.5 ms on accelerators (each interval adds to
    the push handoff), every 10 ms on CPU (engines share few cores), or as configured."""
    from kvferry.connectors.config import BUSY_POLL_S, IDLE_POLL_S

    assert ConnectorConfig(hardware_backend="cuda").notif_poll_s == BUSY_POLL_S == 0.0005
    assert ConnectorConfig(hardware_backend="neuron").notif_poll_s == BUSY_POLL_S
    assert ConnectorConfig(hardware_backend="cpu").notif_poll_s == IDLE_POLL_S == 0.01
    assert ConnectorConfig(hardware_backend="cpu", notif_poll_ms=2).notif_poll_s == 0.002


def test_idle_wait_only_between_two_idle_steps() -> None:
    from kvferry.connectors.connector import idle_wait_s

    assert idle_wait_s(True, True, False, 5.0) == pytest.approx(0.005)
    assert idle_wait_s(True, False, False, 5.0) == 0.0  # right after a forward
    assert idle_wait_s(True, True, True, 5.0) == 0.0  # right after delivering results
    assert idle_wait_s(False, True, False, 5.0) == 0.0  # this step computes
