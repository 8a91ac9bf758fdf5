"""Transfer counters (connectors/transfer/stats.py) and their side-channel request.

The counters are what the e2e tests assert on instead of log lines, so they are checked
here on real in-process NIXL transfers (two TransferWorkers, tests/helpers_workers.py), read
back through the side channel exactly as tests/stack.py reads an engine's.
"""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path

import helpers_workers
import msgspec
import pytest
import zmq
from helpers_http import free_port
from helpers_workers import D_BLOCKS, P_BLOCKS, Engine, N, blocks_of, d_register, d_task, p_done, p_finish

from kvferry.connectors.transfer.handshake import (
    HandshakeError,
    HandshakeServer,
    fetch,
    fetch_engine_stats,
    fetch_stats,
)
from kvferry.connectors.transfer.stats import COUNTERS, MAX_EVENTS, Snapshot, Stats, decode

engines = helpers_workers.engines  # in-process P and D workers over real NIXL
pytestmark = pytest.mark.timeout(60)


def side(e: Engine, timeout_s: float = 2.0) -> Snapshot:
    """``e``'s counters as a test reads an engine's: over its side channel."""
    return fetch_stats("127.0.0.1", e.port, timeout_s)


def block_bytes(e: Engine) -> int:
    return sum(t.nbytes for t in blocks_of(e.kv, [0]))


# -- the object ---------------------------------------------------------------------------
def test_snapshot_names_every_counter_and_the_events():
    s = Stats("E", 3)
    s.event("reads_done", "r1")
    s.event("reads_failed", "r2", "timed out")
    s.add("bytes_read", 4096)
    snap = s.snapshot()
    assert set(snap.counters) == set(COUNTERS)
    assert (snap["reads_done"], snap["reads_failed"], snap["bytes_read"], snap["writes_done"]) \
        == (1, 1, 4096, 0)
    assert [(e.name, e.key, e.detail) for e in snap.events] == \
        [("reads_done", "r1", ""), ("reads_failed", "r2", "timed out")]
    assert snap.engine_id == "E" and snap.ranks == [3] and snap.events_dropped == 0
    assert decode(s.encode()) == snap


def test_event_ring_is_bounded_and_counts_what_it_dropped():
    s = Stats()
    for i in range(MAX_EVENTS + 5):
        s.event("writes_done", f"t{i}")
    snap = s.snapshot()
    assert snap["writes_done"] == MAX_EVENTS + 5  # counters never drop
    assert len(snap.events) == MAX_EVENTS and snap.events_dropped == 5
    assert snap.events[0].key == "t5" and snap.find("writes_done", f"t{MAX_EVENTS + 4}")


def test_concurrent_counting_loses_nothing():
    s = Stats()
    stop = threading.Event()
    seen: list[int] = []

    def reader() -> None:  # the side-channel thread snapshots while the transfer thread counts
        while not stop.is_set():
            seen.append(s.snapshot()["notifications"])

    def counter() -> None:
        for _ in range(5000):
            s.add("notifications")
            s.event("reads_done", "r")

    r = threading.Thread(target=reader)
    r.start()
    ts = [threading.Thread(target=counter) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    stop.set()
    r.join()
    snap = s.snapshot()
    assert snap["notifications"] == snap["reads_done"] == 20000
    assert seen == sorted(seen)  # every snapshot is consistent: monotonic


def test_merge_sums_ranks():
    a, b = Stats("P", 0), Stats("P", 1)
    a.event("writes_done", "t")
    b.event("writes_done", "t")
    b.add("bytes_written", 10)
    m = Snapshot.merge([a.snapshot(), b.snapshot()])
    assert m["writes_done"] == 2 and m["bytes_written"] == 10 and m.ranks == [0, 1]
    assert len(m.find("writes_done", "t")) == 2 and m.engine_id == "P"


def test_since_returns_each_ranks_new_events_only():
    a, b = Stats("P", 0), Stats("P", 1)
    a.event("writes_done", "old")
    before = Snapshot.merge([a.snapshot(), b.snapshot()])
    b.event("writes_done", "new1")
    a.event("writes_failed", "new0", "error")
    after = Snapshot.merge([a.snapshot(), b.snapshot()])
    assert sorted((e.key, e.rank) for e in after.since(before)) == [("new0", 0), ("new1", 1)]
    assert after.since(after) == []


def test_every_counter_the_code_counts_is_declared():
    """A typo in a counter name would silently count under a name no reader asks for."""
    used = set()
    for f in (Path(__file__).resolve().parents[1] / "connectors").rglob("*.py"):
        for call in ast.walk(ast.parse(f.read_text())):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr in ("event", "add") and call.args
                    and (isinstance(call.func.value, ast.Attribute)
                         and call.func.value.attr == "stats"
                         or isinstance(call.func.value, ast.Name)  # a Stats handed in
                         and call.func.value.id == "stats")):
                used |= {c.value for c in ast.walk(call.args[0])
                         if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    assert {"reads_done", "reuse_reads_failed", "writes_done", "push_failed"} <= used
    assert used <= set(COUNTERS), used - set(COUNTERS)


# -- the side channel ---------------------------------------------------------------------
def test_stats_request_round_trip_and_hello_unchanged():
    payload = {"engine_id": "P0", "rank": 0, "metadata": b"\x00nixl"}
    port = free_port()
    srv = HandshakeServer("127.0.0.1", port, payload)
    try:
        assert fetch_stats("127.0.0.1", port, 2)["reads_done"] == 0  # no stats set yet: zeros
        srv.stats = Stats("P0", 0)
        srv.stats.event("reuse_reads_done", "req-1")
        got = fetch_stats("127.0.0.1", port, 2)
        assert got["reuse_reads_done"] == 1 and got.find("reuse_reads_done", "req-1")
        srv.stats.add("bytes_read", 7)  # live, not a copy taken at start
        assert fetch_stats("127.0.0.1", port, 2)["bytes_read"] == 7
        assert fetch("127.0.0.1", port, 2) == payload  # peers' handshake as before
    finally:
        srv.close()


def test_engine_stats_sum_its_tp_ranks():
    port = free_port()
    servers = [HandshakeServer("127.0.0.1", port + r, {"rank": r}) for r in range(2)]
    try:
        for r, s in enumerate(servers):
            s.stats = Stats("P", r)
            s.stats.event("writes_done", "t")
        m = fetch_engine_stats("127.0.0.1", port, 2, timeout_s=2)
        assert m["writes_done"] == 2 and sorted(m.ranks) == [0, 1]
    finally:
        for s in servers:
            s.close()


@pytest.mark.timing
def test_dead_peer_is_a_clear_error_within_the_deadline():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(HandshakeError, match=f"no stats from 127.0.0.1:{port} within 0.3s"):
        fetch_stats("127.0.0.1", port, timeout_s=0.3)
    assert time.monotonic() - t0 < 2.0


def test_a_peer_answering_something_else_is_a_clear_error():
    """An older side channel answers every request with its handshake payload."""
    rep = zmq.Context.instance().socket(zmq.REP)
    rep.setsockopt(zmq.LINGER, 0)
    port = rep.bind_to_random_port("tcp://127.0.0.1")

    def answer() -> None:
        if rep.poll(3000):
            rep.recv()
            rep.send(msgspec.msgpack.encode({"engine_id": "old", "metadata": b"x"}))

    th = threading.Thread(target=answer)
    th.start()
    try:
        with pytest.raises(HandshakeError, match="answered no stats snapshot"):
            fetch_stats("127.0.0.1", port, timeout_s=2)
    finally:
        th.join(5)
        rep.close()


# -- counted on real transfers --------------------------------------------------------------
def test_pull_read_counts_on_d_and_its_notice_on_p(engines):
    p, d = engines("P", seed=21), engines("D")
    d0, p0 = side(d), side(p)
    offer = p_finish(p, "p-req", P_BLOCKS)
    p.worker.submit(p.sched.take_meta())
    d.worker.submit(d_task(d, "d-req", offer, D_BLOCKS))
    assert d.collect(lambda r: "d-req" in r.recvd, 15).bad_blocks == set()
    assert p.collect(lambda r: "p-req" in r.sent, 10).sent == {"p-req"}  # P saw D's notice
    d1, p1 = side(d), side(p)
    assert d1["reads_done"] - d0["reads_done"] == 1 and d1.find("reads_done", "d-req")
    assert d1["bytes_read"] - d0["bytes_read"] == len(D_BLOCKS) * block_bytes(d)
    assert d1["reads_failed"] == d1["recomputes"] == 0
    assert p1["notifications"] - p0["notifications"] == 1 and p1["reads_done"] == 0
    assert d1.engine_id == d.engine_id and d1.counters == d.worker.stats.snapshot().counters


def test_failed_read_counts_a_failure_and_a_recompute(engines):
    p, d = engines("P", seed=22), engines("D", handshake_timeout_s=0.5)
    p.sched.pull.port = free_port()  # the offer names a port nobody listens on
    offer = p_finish(p, "p-req", P_BLOCKS)
    d.worker.submit(d_task(d, "d-req", offer, D_BLOCKS))
    assert d.collect(lambda r: "d-req" in r.recvd, 5).bad_blocks == set(D_BLOCKS)
    snap = side(d)
    assert (snap["reads_done"], snap["reads_failed"], snap["recomputes"]) == (0, 1, 1)
    (ev,) = snap.find("reads_failed", "d-req")
    assert ev.detail.startswith("not started")


def test_push_write_counts_on_both_sides(engines):
    p, d = engines("P", seed=23), engines("D")
    d_register(d, p, "d1", "t1", D_BLOCKS)
    p_done(p, "p1", "t1", P_BLOCKS)
    assert d.collect(lambda r: "d1" in r.recvd, 15).bad_blocks == set()
    assert p.collect(lambda r: "p1" in r.sent, 10).sent == {"p1"}
    ps, ds = side(p), side(d)
    assert [e.detail for e in ps.find("registrations", "t1")] == [d.engine_id]
    assert len(ps.find("writes_done", "t1")) == 1 and ps["writes_failed"] == 0
    assert ps["bytes_written"] == len(P_BLOCKS) * block_bytes(p)
    assert ds.find("push_received", "t1") and ds["push_failed"] == ds["recomputes"] == 0


def test_unmatched_registration_counts_rejection_and_recompute(engines):
    """No P leg comes: P's register timeout rejects, D counts the failed push."""
    p, d = engines("P", push_register_timeout_s=0.3), engines("D")
    d_register(d, p, "d1", "t9", D_BLOCKS)
    assert d.collect(lambda r: "d1" in r.recvd, 10).bad_blocks == set(D_BLOCKS)
    (rej,) = side(p).find("rejections", "t9")
    ds = side(d)
    (failed,) = ds.find("push_failed", "t9")
    assert rej.detail and rej.detail in failed.detail  # D heard P's reason
    assert ds["recomputes"] == 1 and side(p)["writes_done"] == 0
    assert not any(t.any() for t in blocks_of(d.kv, list(range(N))))
