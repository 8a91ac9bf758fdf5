"""kvferry's Transport over NIXL's LIBFABRIC backend (the trn2/EFA data path), for real:
READ/WRITE of 1..1024 blocks byte-exact with one notification, merged and unmerged
descriptor lists, multi-lane reads, who sends a notification and when, idle CPU.

Here libfabric's tcp provider stands in for EFA: the same NIXL plugin, descriptors,
notifications and completion paths, host memory, no NIC. Every agent runs in its own
spawned process (tests/helpers_libfabric.py); the test process only orchestrates and
compares per-block digests computed from the tensors themselves. Skips when the
vendored libfabric is absent or not built (.ci/setup)."""

from __future__ import annotations

import time

import helpers_libfabric
import libfabric_host
import pytest
from helpers_libfabric import CFG, NB, N, expected_ndesc, id_pairs, move

from kvferry.connectors.memory.backends import KVLayout

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(libfabric_host.skip_reason() is not None,
                                 reason=str(libfabric_host.skip_reason()))]

mixed = helpers_libfabric.mixed
big = helpers_libfabric.big


def test_agents_run_the_libfabric_backend(mixed) -> None:
    p, d = mixed
    assert p.backends == d.backends == ["LIBFABRIC"]


@pytest.mark.parametrize("op", ["READ", "WRITE"])
@pytest.mark.parametrize("n,pattern", [(1, "runs"), (2, "scattered"), (7, "runs"), (63, "scattered"),
                                       (1024, "runs"), (1024, "scattered")])
def test_blocks_move_byte_exact_with_one_notification(mixed, op: str, n: int, pattern: str) -> None:
    p, d = mixed
    local, remote = id_pairs(n, pattern)
    lay = KVLayout.from_wire(d.wire)
    ndesc, nbytes = move(p, d, op, local, remote, f"kvferry/{op}/{n}/{pattern}".encode())
    assert ndesc == expected_ndesc(lay, local, remote, merge=True)
    assert nbytes == n * sum(pl.block_bytes for pl in lay.planes)
    if pattern == "runs" and n > 3:  # merged: 3 descriptors per dense plane, not n
        assert ndesc < n * len(lay.planes)


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_unmerged_1024_blocks_post_more_descriptors_than_the_plugins_request_pool(mixed, op: str) -> None:
    """merge=False posts one descriptor per block and plane: 4096 here, four times the
    plugin's 1024 data requests per rail (NIXL_LIBFABRIC_DATA_REQUESTS_PER_RAIL)."""
    p, d = mixed
    local, remote = list(range(N)), list(range(N))
    ndesc, _ = move(p, d, op, local, remote, f"kvferry/unmerged/{op}".encode(), merge=False)
    assert ndesc == N * len(KVLayout.from_wire(d.wire).planes) > 1024


def test_multi_lane_read_notifies_once_after_every_lane(mixed) -> None:
    p, d = mixed
    local, remote = id_pairs(1024, "scattered")
    ndesc, _ = move(p, d, "READ", local, remote, b"kvferry/lanes", merge=True, lanes=4)
    assert ndesc == expected_ndesc(KVLayout.from_wire(d.wire), local, remote, merge=True)


def test_empty_transfer_and_plain_notifications_both_ways(mixed) -> None:
    p, d = mixed
    xid, ndesc, nbytes, handles = d("start", "READ", "P", [], [], b"kvferry/release")
    assert (ndesc, nbytes, handles) == (0, 0, 0) and d("poll", xid) == "DONE"
    assert p("notifs", 10, 1) == [b"kvferry/release"]
    d("notify", "P", b"d->p")
    p("notify", "D", b"p->d")
    assert p("notifs", 10, 1) == [b"d->p"] and d("notifs", 10, 1) == [b"p->d"]
    big_msg = bytes(range(256)) * 40  # 10 KiB: more than one 8 KiB control message
    d("notify", "P", big_msg)
    assert p("notifs", 10, 1) == [big_msg]


def test_read_notification_is_sent_by_the_readers_poll(big) -> None:
    """UCX delivers a READ's notification from its progress thread; the LIBFABRIC plugin
    sends it from check_xfer_state once the READ is complete: P hears nothing while D
    does not poll, even with every byte already in D's memory."""
    p, d = big
    p("fill", 5)
    d("fill", 6)
    ids = list(range(NB))
    want = p("digests", ids)
    xid, *_ = d("start", "READ", "P", ids, ids, b"kvferry/read-needs-poll")
    deadline = time.monotonic() + CFG.recv_timeout_s
    while d("digests", ids) != want:  # the data lands without D polling the transfer
        assert time.monotonic() < deadline, "READ data did not land"
    assert p("notifs", 0.5, 1) == []
    assert d("wait", xid, CFG.recv_timeout_s)[0] == "DONE"
    assert p("notifs", 10, 1) == [b"kvferry/read-needs-poll"]


def test_write_notification_arrives_after_all_its_data(big) -> None:
    """D's WRITE DONE only means its source may be reused; P learns the data is there
    from the notification, which the plugin delivers once P has counted every write's
    remote completion (so P's bytes are complete the moment it sees it)."""
    p, d = big
    p("fill", 7)
    d("fill", 8)
    ids = list(range(NB))
    want = d("digests", ids)
    assert p("digests", ids) != want
    xid, *_ = d("start", "WRITE", "P", ids, ids[::-1], b"kvferry/wrote")
    got, at_notif = p("notif_digests", CFG.recv_timeout_s, ids[::-1], timeout=CFG.recv_timeout_s + 30)
    assert got == [b"kvferry/wrote"]
    assert at_notif == want
    assert d("wait", xid, CFG.recv_timeout_s)[0] == "DONE"


def test_idle_libfabric_agents_do_not_spin(mixed) -> None:
    """The plugin's progress thread polls its completion queues and sleeps the agent's
    pthrDelay between idle polls (no wake-up on events, unlike UCX): kvferry's
    nixl_progress_delay_us keeps that near zero CPU instead of a core per agent."""
    p, d = mixed
    assert CFG.nixl_progress_delay_us > 0
    assert d("idle_cores", 2.0) < 0.25 and p("idle_cores", 2.0) < 0.25
