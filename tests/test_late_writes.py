"""A WRITE or READ that completes after its request was given up never touches blocks
that were handed back for another request (issue 36, item 2).

Real NIXL between two in-process workers (tests/helpers_workers.py). The fault hook
(connectors/transfer/faults.py) holds a transfer's posting back (``post`` ``delay``), so
the data lands seconds after the abort, as a WRITE a NIC still has queued would. The
moment a worker reports a request's blocks free, the test writes a marker into them (the
next request owning them); any byte of the late transfer landing afterwards shows.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import helpers_workers
import pytest
import torch
from helpers_workers import (
    D_BLOCKS,
    P_BLOCKS,
    PROMPT,
    Engine,
    d_register,
    d_task,
    install_fault_plan,
    p_done,
    p_finish,
    settle,
    written,
)

engines = helpers_workers.engines  # in-process P and D workers over real NIXL
pytestmark = pytest.mark.timeout(60)

MARK = 7.0  # what the blocks' next owner wrote into them
LAG_S = 1.5  # the transfer lands this long after it was decided, past the abort


@pytest.fixture
def hooks(monkeypatch, tmp_path):
    return install_fault_plan(monkeypatch, tmp_path, "test")


def hits(events: Path, point: str) -> int:
    return sum(json.loads(line)["point"] == point
               for f in events.glob("*.jsonl") for line in f.read_text().splitlines())


def wait_hit(events: Path, point: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while hits(events, point) == 0:
        assert time.monotonic() < deadline, f"the {point} hook never fired"
        time.sleep(0.01)


def reuse(e: Engine, ids: list[int]) -> None:
    """Another request now owns ``ids``: it writes its own KV there."""
    e.kv["l0"][:, ids] = MARK
    e.kv["l1"][ids] = MARK


def still_reused(e: Engine, ids: list[int]) -> bool:
    return bool((e.kv["l0"][:, ids] == MARK).all() and (e.kv["l1"][ids] == MARK).all())


def d_abort(d: Engine, p: Engine, req: str, tid: str) -> None:
    """D's request is cancelled (client gone, router timeout, migration) mid-push."""
    params = {"do_remote_prefill": True, "push": True, "transfer_id": tid,
              "remote_host": "127.0.0.1", "remote_port": p.port}
    keep, _ = d.sched.finished(req, False, D_BLOCKS, params, PROMPT)
    assert not keep
    meta = d.sched.take_meta()
    assert meta.push_abort_d == [tid]
    d.worker.submit(meta)


def test_push_write_landing_after_d_abort_never_reaches_reused_blocks(engines, hooks):
    """P matched D's registration and its WRITE is on its way when D's request is
    aborted. D hands the blocks back only once P said the WRITE ended (its Wrote after
    the data), never on a grace period shorter than P's WRITE timeout (on cdd3802: after
    push_quarantine_s, 0.2 s here, so the WRITE landed in the next owner's blocks)."""
    p = engines("P", seed=21, recv_timeout_s=5.0)
    d = engines("D", recv_timeout_s=5.0, push_quarantine_s=0.2)
    events = hooks([{"point": "post", "action": "delay", "s": LAG_S, "p": 1.0}])
    d_register(d, p, "d1", "t1", D_BLOCKS)
    p_done(p, "p1", "t1", P_BLOCKS)
    wait_hit(events, "post")  # P decided the WRITE; it lands LAG_S later
    t0 = time.monotonic()
    d_abort(d, p, "d1", "t1")
    got = d.collect(lambda r: "d1" in r.recvd, 15)
    released_after = time.monotonic() - t0
    reuse(d, D_BLOCKS)
    assert got.recvd == {"d1"} and got.bad_blocks == set(D_BLOCKS)  # never decoded
    assert p.collect(lambda r: "p1" in r.sent, 15).sent == {"p1"}  # P's WRITE ended
    settle(d)
    assert still_reused(d, D_BLOCKS), f"WRITE landed in blocks freed {released_after:.2f} s after the abort"
    assert released_after < 5.0  # P's word, not the fallback (recv_timeout_s + quarantine)
    assert p.worker.stats.snapshot().counters["writes_done"] == 1
    assert d.worker.push_recv.num_tracked == 0 and p.worker.push_write.num_tracked == 0


def test_unwritten_blocks_after_d_abort_are_released_on_p_word(engines, hooks):
    """Control: the same abort before P matched anything releases D's blocks at once on
    P's Reject, and no WRITE is ever posted."""
    p = engines("P", seed=22, recv_timeout_s=5.0)
    d = engines("D", recv_timeout_s=5.0, push_quarantine_s=0.2)
    events = hooks([{"point": "post", "action": "delay", "s": LAG_S, "p": 1.0}])
    d_register(d, p, "d1", "t1", D_BLOCKS)
    deadline = time.monotonic() + 10
    while p.worker.push_write.matcher.state("t1") != "waiting_prefill":
        assert time.monotonic() < deadline, "registration never reached P"
        time.sleep(0.01)
    before = [t.clone() for t in (d.kv["l0"][:, D_BLOCKS], d.kv["l1"][D_BLOCKS])]
    t0 = time.monotonic()
    d_abort(d, p, "d1", "t1")
    got = d.collect(lambda r: "d1" in r.recvd, 15)
    assert got.bad_blocks == set(D_BLOCKS) and time.monotonic() - t0 < 5.0
    p_done(p, "p1", "t1", P_BLOCKS)  # the prefill ends after the abort: freed, not written
    assert p.collect(lambda r: "p1" in r.sent, 10).sent == {"p1"}
    settle(d)
    assert hits(events, "post") == 0
    assert torch.equal(before[0], d.kv["l0"][:, D_BLOCKS]) and torch.equal(before[1], d.kv["l1"][D_BLOCKS])


def test_pull_read_in_flight_at_its_deadline_keeps_both_sides_blocks_until_it_ended(
        engines, hooks):
    """D's READ is still in flight (the transport reports it running, ``done_hold``) when
    its deadline passes. D fences it (drops P's agent) and hands its blocks back, and
    tells P to free its own, only once the transport reported the READ ended: never while
    the READ may still write D's blocks or read P's (on cdd3802 both went at the deadline,
    2 s, with the READ reported running for 5 s)."""
    hold_s = 5.0
    p = engines("P", seed=23, send_timeout_s=60.0)
    d = engines("D", recv_timeout_s=2.0)  # the READ itself takes milliseconds
    offer = p_finish(p, "p-req", P_BLOCKS)
    p.worker.submit(p.sched.take_meta())
    events = hooks([{"point": "done_hold", "action": "delay", "s": hold_s, "p": 1.0}])
    t0 = time.monotonic()
    d.worker.submit(d_task(d, "d-req", offer, D_BLOCKS))
    got = d.collect(lambda r: "d-req" in r.recvd, 15)
    d_after = time.monotonic() - t0
    assert got.bad_blocks == set(D_BLOCKS)  # past its deadline: D recomputes
    assert p.collect(lambda r: "p-req" in r.sent, 15).sent == {"p-req"}  # P hears, and frees
    p_after = time.monotonic() - t0
    assert hits(events, "done_hold") == 1
    assert d_after >= hold_s - 0.1, f"D's blocks went {d_after:.2f} s in, the READ ran {hold_s} s"
    assert p_after >= hold_s - 0.1, f"P's blocks went {p_after:.2f} s in, the READ ran {hold_s} s"
    counters = d.worker.stats.snapshot().counters
    assert counters["transfers_fenced"] == 1 and counters["transfers_unfenced"] == 0
    assert counters["reads_failed"] == 1 and counters.get("reads_done", 0) == 0
    assert not d.worker.reads.busy()


def test_push_write_in_flight_at_p_timeout_frees_p_blocks_only_once_it_ended(engines, hooks):
    """P's WRITE is reported running (``done_hold``) past P's WRITE timeout. P fences it
    (drops D's agent) and frees its source blocks, and tells D, only once the transport
    reported it ended (on cdd3802: at the timeout, 2 s, while it was reported running)."""
    hold_s = 5.0
    p = engines("P", seed=24, recv_timeout_s=2.0)  # the WRITE itself takes milliseconds
    d = engines("D")
    d_register(d, p, "d1", "t1", D_BLOCKS)
    deadline = time.monotonic() + 10
    while p.worker.push_write.matcher.state("t1") != "waiting_prefill":
        assert time.monotonic() < deadline, "registration never reached P"
        time.sleep(0.01)
    events = hooks([{"point": "done_hold", "action": "delay", "s": hold_s, "p": 1.0}])
    t0 = time.monotonic()
    p_done(p, "p1", "t1", P_BLOCKS)
    assert p.collect(lambda r: "p1" in r.sent, 15).sent == {"p1"}
    p_after = time.monotonic() - t0
    assert hits(events, "done_hold") == 1
    assert p_after >= hold_s - 0.1, f"P's blocks went {p_after:.2f} s in, the WRITE ran {hold_s} s"
    counters = p.worker.stats.snapshot().counters
    assert counters["transfers_fenced"] == 1 and counters["transfers_unfenced"] == 0
    assert counters["writes_failed"] == 1 and counters.get("writes_done", 0) == 0
    assert p.worker.push_write.num_tracked == 0
    # The data did land (NIXL sent the Wrote after it): D decodes what P wrote.
    got = d.collect(lambda r: "d1" in r.recvd, 10)
    assert got.recvd == {"d1"} and got.bad_blocks == set() and written(d, p, D_BLOCKS, P_BLOCKS)


def test_quarantine_for_a_p_that_died_ends_when_its_process_is_gone(engines):
    """D registered with P, then P's process died and D's request was aborted: nobody
    will say the WRITE ended, and the fallback is P's WRITE timeout (30 s). D releases
    once P's side channel refuses connections (a dead process writes nothing more)."""
    p, d = engines("P", seed=25), engines("D", push_quarantine_s=1.0)
    d_register(d, p, "d1", "t1", D_BLOCKS)
    deadline = time.monotonic() + 10
    while p.worker.push_write.matcher.state("t1") != "waiting_prefill":
        assert time.monotonic() < deadline, "registration never reached P"
        time.sleep(0.01)
    p.worker.close()
    t0 = time.monotonic()
    d_abort(d, p, "d1", "t1")
    got = d.collect(lambda r: "d1" in r.recvd, 20)
    assert got.recvd == {"d1"} and got.bad_blocks == set(D_BLOCKS)
    assert time.monotonic() - t0 < 10 < d.cfg.recv_timeout_s
    assert d.worker.stats.snapshot().counters["push_writer_gone"] == 1
    assert d.worker.push_recv.num_tracked == 0
