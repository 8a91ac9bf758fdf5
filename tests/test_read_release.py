"""A pull READ that D gives up (failed post, error, timeout) still tells P to free its
blocks at once, instead of P holding them until send_timeout_s ("no decode read its KV
within 120s" in a 2P2D run whose READs fell back). Real NIXL between two in-process
workers (tests/helpers_workers.py); the failures come from the test-only fault
hooks (connectors/transfer/faults.py)."""

from __future__ import annotations

import time

import helpers_workers
import pytest
from helpers_workers import D_BLOCKS, P_BLOCKS, d_task, install_fault_plan, p_finish

engines = helpers_workers.engines  # in-process P and D workers over real NIXL
pytestmark = pytest.mark.timeout(60)

SEND_TIMEOUT_S = 60.0  # far beyond the test: a free within seconds is D's notice


@pytest.fixture
def hooks(monkeypatch, tmp_path):
    return install_fault_plan(monkeypatch, tmp_path, "d")


def _read(engines, d_cfg: dict):
    p = engines("P", seed=11, send_timeout_s=SEND_TIMEOUT_S)
    d = engines("D", **d_cfg)
    offer = p_finish(p, "p-req", P_BLOCKS)
    p.worker.submit(p.sched.take_meta())
    return p, d, offer


@pytest.mark.parametrize("rule, d_cfg", [
    # The READ cannot be posted: only D's notice can free P (fails without it).
    ({"point": "post", "action": "drop"}, {}),
    # The READ landed, but D saw it after its deadline: P hears once (the READ's own
    # notice, or D's), never a free for blocks still being read.
    ({"point": "done_hold", "action": "delay", "s": 3.0}, {"recv_timeout_s": 0.5}),
], ids=["post_failed", "seen_late"])
def test_abandoned_read_frees_p_now(engines, hooks, rule, d_cfg):
    p, d, offer = _read(engines, d_cfg)
    hooks([{**rule, "p": 1.0}])
    t0 = time.monotonic()
    d.worker.submit(d_task(d, "d-req", offer, D_BLOCKS))
    got = d.collect(lambda r: "d-req" in r.recvd, 10)
    assert got.bad_blocks == set(D_BLOCKS)  # D recomputes
    hooks([])
    assert p.collect(lambda r: "p-req" in r.sent, 10).sent == {"p-req"}
    assert time.monotonic() - t0 < 10 < SEND_TIMEOUT_S


def test_read_that_succeeds_frees_p_once(engines):
    p, d, offer = _read(engines, {})
    d.worker.submit(d_task(d, "d-req", offer, D_BLOCKS))
    assert d.collect(lambda r: "d-req" in r.recvd, 10).bad_blocks == set()
    assert p.collect(lambda r: "p-req" in r.sent, 10).sent == {"p-req"}
    time.sleep(0.5)
    assert p.worker.results().sent == set()  # one notice, one free
