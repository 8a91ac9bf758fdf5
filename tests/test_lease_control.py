"""Lease control channel: signed, time-stamped requests (connectors/protocol/lease_control.py);
D's `handle` never raises (connectors/transfer/lease_control.py); real ZMQ round trips
between the router's `call` (router/conversations/lease_control.py) and a `ControlServer`."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from helpers_http import free_port

from kvferry.connectors.protocol import lease_control as wire
from kvferry.connectors.protocol.params import SECRET_ENV, mac, parse_lease
from kvferry.connectors.scheduling.lease_keeper import LeaseKeeper
from kvferry.connectors.transfer import lease_control as lc
from kvferry.router.conversations import lease_control as client

KEY = b"test-secret"
BS = 4
TOKENS = list(range(16))


@pytest.fixture(autouse=True)
def _secret(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, KEY.decode())



def make_keeper(**kw) -> LeaseKeeper:
    k = LeaseKeeper("D0", "boot-1", "127.0.0.1", 5700, BS, ttl=100.0, free_grace=0.0, **kw)
    for lid in ("L1", "L2"):
        assert k.grant(f"req-{lid}", {"lease_id": lid, "ttl": 50}, [1, 2, 3, 4], TOKENS, 16)
    return k


def blob(key: bytes = KEY, **fields) -> bytes:
    """A request with chosen fields, signed over them with ``key``."""
    req = {"op": "info", "lease_id": "L1", "ttl": None, "ts": time.time(), **fields}
    if "sig" not in req:
        req["sig"] = mac(wire.LeaseControl(req["op"], req["lease_id"], req["ts"], req["ttl"]), key)
    return msgspec.msgpack.encode(req)


# -- handle -------------------------------------------------------------------------------------
def test_good_request_answers_with_signed_offer():
    k = make_keeper()
    r = lc.handle(k, wire.request("info", "L1", key=KEY), key=KEY)
    assert r["ok"] is True and parse_lease(r["offer"], key=KEY).lease_id == "L1"
    r = lc.handle(k, wire.request("info", "L1"))  # both sides default to KVFERRY_SECRET
    assert r["ok"] is True


def test_bad_signature():
    k = make_keeper()
    assert lc.handle(k, wire.request("release", "L1", key=b"other"), key=KEY) == \
        {"ok": False, "error": "bad_signature"}
    tampered = msgspec.msgpack.decode(wire.request("renew", "L1", 5.0, key=KEY))
    tampered["ttl"] = 5000.0  # signed for another ttl
    assert lc.handle(k, msgspec.msgpack.encode(tampered), key=KEY)["error"] == "bad_signature"
    tampered["ttl"], tampered["lease_id"] = 5.0, "L2"  # signed for another lease
    assert lc.handle(k, msgspec.msgpack.encode(tampered), key=KEY)["error"] == "bad_signature"
    # A server without a secret refuses everything, even a request "signed" with none.
    assert lc.handle(k, wire.request("release", "L1", key=b""), key=b"")["error"] == "bad_signature"
    assert "L1" in k.table  # nothing was released


def test_stale_or_future_timestamp():
    k = make_keeper()
    req = wire.request("release", "L1", key=KEY)
    now = time.time()
    assert lc.handle(k, req, key=KEY, now=now + wire.MAX_SKEW_S + 5) == {"ok": False, "error": "stale"}
    assert lc.handle(k, req, key=KEY, now=now - wire.MAX_SKEW_S - 5)["error"] == "stale"
    assert "L1" in k.table
    assert lc.handle(k, req, key=KEY, now=now + wire.MAX_SKEW_S - 5) == {"ok": True}
    assert "L1" not in k.table


MALFORMED = {
    "empty": b"",
    "not_msgpack": b"\xc1\xff garbage",
    "list": msgspec.msgpack.encode(["info", "L1", None, 1.0, "0" * 64]),
    "str": msgspec.msgpack.encode("info"),
    "no_ts_no_sig": msgspec.msgpack.encode({"op": "info", "lease_id": "L1"}),
    "unknown_op_signed": blob(op="delete"),
    "op_none": blob(op=None),
    "lease_id_int": blob(lease_id=7),
    "sig_int": blob(sig=123),
    "sig_non_ascii": blob(sig="\u00e9" * 64),  # hmac.compare_digest would raise
    "ts_str_signed": blob(ts="soon"),
    "ts_none_signed": blob(ts=None),
    "ts_bool_signed": blob(ts=True),
    "ts_nan_signed": blob(ts=float("nan")),  # would pass any staleness check
    "ts_inf_signed": blob(ts=float("inf")),
    "ttl_zero": blob(op="renew", ttl=0),
    "ttl_negative": blob(op="renew", ttl=-1.0),
    "ttl_str": blob(op="renew", ttl="60"),
    "ttl_nan": blob(op="renew", ttl=float("nan")),
}


@pytest.mark.parametrize("raw", list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_requests_are_bad_request_never_raise(raw):
    k = make_keeper()
    assert lc.handle(k, raw, key=KEY) == {"ok": False, "error": "bad_request"}
    assert len(k.table) == 2


def test_request_refuses_unknown_op():
    with pytest.raises(ValueError):
        wire.request("delete", "L1", key=KEY)


def test_keeper_errors_become_reasons():
    k = make_keeper()
    assert lc.handle(k, wire.request("info", "nope", key=KEY), key=KEY) == \
        {"ok": False, "error": "unknown"}
    assert lc.handle(k, wire.request("release", "L1", key=KEY), key=KEY) == {"ok": True}
    for op in ("info", "renew", "release"):
        assert lc.handle(k, wire.request(op, "L1", key=KEY), key=KEY)["error"] == "released"


def test_keeper_bug_is_reported_not_raised():
    class Broken:
        def info(self, lease_id, for_read=False):
            raise RuntimeError("boom")

    r = lc.handle(Broken(), wire.request("info", "L1", key=KEY), key=KEY)
    assert r["ok"] is False and r["error"].startswith("internal") and "boom" in r["error"]


# -- over ZMQ ------------------------------------------------------------------------------------
@pytest.fixture
def served():
    k = make_keeper()
    port = free_port()
    server = lc.ControlServer(k, "127.0.0.1", port)
    assert server.address == f"127.0.0.1:{port}"
    yield k, port
    server.close()


def test_round_trips_through_control_server(served):
    k, port = served

    async def go():
        def call(op, lid, ttl=None, key=KEY):
            return client.call(("127.0.0.1", port), op, lid, ttl, timeout_s=5.0, key=key)

        r = await call("info", "L1")
        assert r["ok"] is True
        first = parse_lease(r["offer"], key=KEY)
        assert first.lease_id == "L1" and first.block_ids == [1, 2, 3, 4]
        r = await call("renew", "L1", 80.0)
        assert r["ok"] is True
        renewed = parse_lease(r["offer"], key=KEY)
        assert renewed.expiry > first.expiry and k.table.get("L1").expiry == renewed.expiry
        r = await call("renew", "L1")  # D's own ttl (100 s)
        assert parse_lease(r["offer"], key=KEY).expiry >= renewed.expiry
        assert await call("release", "L1") == {"ok": True}
        assert "L1" not in k.table and k.due_frees() == ["req-L1"]
        assert await call("info", "L1") == {"ok": False, "error": "released"}
        assert await call("renew", "L1") == {"ok": False, "error": "released"}
        assert await call("info", "nope") == {"ok": False, "error": "unknown"}
        # The server checks against KVFERRY_SECRET: another key is refused, and the
        # channel keeps serving afterwards.
        assert await call("release", "L2", key=b"other") == {"ok": False, "error": "bad_signature"}
        assert "L2" in k.table
        assert (await call("info", "L2", key=None))["ok"] is True  # key from the env

    asyncio.run(go())


def checked(port: int, lease_id: str, timeout_s: float = 2.0) -> tuple[bool, str | None]:
    check = lc.LeaseCheck("127.0.0.1", port, lease_id)
    try:
        return check.poll(timeout_s)
    finally:
        check.close()


def test_p_asks_whether_a_lease_still_holds_before_reading(served):
    """P's check before a reuse READ (`LeaseCheck`): D may have released the lease early
    (memory pressure) while the router still holds its offer."""
    k, port = served
    assert checked(port, "L1") == (True, None)
    assert k.relieve(1, 100, 0, 0.05) == ["L1"]  # pressure: 1 + L1's 4 blocks cover 5
    assert checked(port, "L1") == (True, "released")
    assert checked(port, "L2") == (True, None)
    assert checked(port, "nope") == (True, "unknown")
    assert checked(free_port(), "L2", 0.2) == (False, None)  # nobody listens: no answer


def test_ps_check_keeps_the_blocks_a_grace_the_routers_lookup_does_not():
    """P's pre-READ "check" marks the lease read (its blocks outlive that READ by the
    grace); the router's "info" (fetching an offer) does not delay a free."""
    k = LeaseKeeper("D0", "boot-1", "127.0.0.1", 5700, BS, ttl=100.0, free_grace=60.0)
    for lid in ("L1", "L2"):
        assert k.grant(f"req-{lid}", {"lease_id": lid, "ttl": 50}, [1, 2, 3, 4], TOKENS, 16)
    for op, lid in (("info", "L1"), ("check", "L2")):
        assert lc.handle(k, wire.request(op, lid, key=KEY), key=KEY)["ok"] is True
        k.release(lid)
    assert k.due_frees() == ["req-L1"]  # L2's blocks wait out P's READ (60 s here)


@pytest.mark.timing
def test_lease_check_never_blocks_the_thread_that_polls_it():
    """P's transfer thread polls `LeaseCheck` between other transfers: before D answers,
    a poll returns at once with no answer; D's answer arrives on a later poll."""
    k = make_keeper()
    port = free_port()
    slow = lc.ControlServer(k, "127.0.0.1", port)
    answer = slow._reply
    slow._reply = lambda blob: (time.sleep(0.4), answer(blob))[1]  # D's control thread, busy
    try:
        check = lc.LeaseCheck("127.0.0.1", port, "L1")
        t0 = time.monotonic()
        assert check.poll() == (False, None)
        assert time.monotonic() - t0 < 0.05
        assert check.poll(5.0) == (True, None)  # held
        assert check.poll() == (True, None)  # the answer stays
        k.release("L2")
        check = lc.LeaseCheck("127.0.0.1", port, "L2")
        assert check.poll(5.0) == (True, "released")
    finally:
        slow.close()


def test_server_survives_garbage(served):
    """A malformed request (no key needed to send one) must not kill the serving thread."""
    k, port = served
    import zmq

    ctx = zmq.Context.instance()
    for raw in (b"junk", blob(sig="\u00e9" * 64), blob(ts="x", key=KEY)):
        s = ctx.socket(zmq.REQ)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{port}")
        try:
            s.send(raw)
            assert s.poll(5000), "control server stopped answering"
            assert msgspec.msgpack.decode(s.recv()) == {"ok": False, "error": "bad_request"}
        finally:
            s.close()
    r = asyncio.run(client.call(("127.0.0.1", port), "info", "L1", timeout_s=5.0, key=KEY))
    assert r["ok"] is True


def test_unreachable_port_fails_fast():
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    r = asyncio.run(client.call(("127.0.0.1", port), "info", "L1", timeout_s=0.2, key=KEY))
    assert r["ok"] is False and r["error"].startswith("unreachable")
    assert time.monotonic() - t0 < 2.0


def test_integer_ttl_is_signed_as_sent():
    """The MAC covers what D decodes: an int ttl goes out as a float."""
    k = make_keeper()
    r = lc.handle(k, wire.request("renew", "L1", 30, key=KEY), key=KEY)
    assert r["ok"] is True
