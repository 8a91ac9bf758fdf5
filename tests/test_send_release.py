"""P's side of the router's send_release (issue 37 item 2): an in-process P TransferWorker
over real NIXL frees what it keeps for a request when the router says no D will read it,
at once rather than after send_timeout_s (pull) or push_hold_timeout_s (push)."""

from __future__ import annotations

import helpers_workers
import msgspec
import pytest
from helpers_workers import P_BLOCKS, p_done, p_finish

from kvferry.connectors.protocol import send_release
from kvferry.connectors.transfer.handshake import request

engines = helpers_workers.engines  # in-process P and D workers over real NIXL
KEY = b"worker-test-secret"  # helpers_workers.engines' KVFERRY_SECRET

pytestmark = pytest.mark.timeout(60)


def tell(port: int, blob: bytes) -> dict:
    return msgspec.msgpack.decode(request("127.0.0.1", port, blob, 5.0, "release"))


def test_pull_offer_is_freed_when_the_router_says_so(engines):
    p = engines("P", send_timeout_s=120.0)
    offer = p_finish(p, "p1", P_BLOCKS)
    p.worker.submit(p.sched.take_meta())  # P keeps the blocks for a D's READ
    assert p.collect(lambda r: "p1" in r.sent, 0.5).sent == set()
    assert tell(p.port, send_release.request("p1", b"forged")) == {
        "ok": False, "error": "bad_signature"}
    assert p.collect(lambda r: "p1" in r.sent, 0.5).sent == set()
    assert tell(p.port, send_release.request(offer["remote_request_id"], KEY)) == {"ok": True}
    assert p.collect(lambda r: "p1" in r.sent, 5).sent == {"p1"}
    assert [e.key for e in p.worker.stats.snapshot().find("sends_released")] == ["p1"]


def test_push_prefill_no_decode_registers_for_is_freed_when_the_router_says_so(engines):
    p = engines("P", push_hold_timeout_s=30.0)
    p_done(p, "p2", "t2", P_BLOCKS)  # prefilled; D refused the request and never registers
    assert p.collect(lambda r: "p2" in r.sent, 0.5).sent == set()
    assert tell(p.port, send_release.request("", KEY, "t2")) == {"ok": True}
    assert p.collect(lambda r: "p2" in r.sent, 5).sent == {"p2"}
    assert p.worker.push_write.num_tracked == 0
