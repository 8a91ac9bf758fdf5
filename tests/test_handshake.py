"""Side-channel handshake (connectors/transfer/handshake.py): round trip, deadlines, bind errors."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import zmq
from helpers_http import free_port

from kvferry.connectors.transfer.handshake import HandshakeError, HandshakeServer, fetch


@pytest.fixture
def server():
    made = []

    def make(payload, port=None):
        s = HandshakeServer("127.0.0.1", port or free_port(), payload)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


PAYLOAD = {"engine_id": "P0", "rank": 1, "metadata": b"\x00\x01nixl\xff" * 50,
           "layout": {"regions": [[1 << 40, 4096, 0, "DRAM"]], "planes": [[0, 1 << 40, 64, 64, 64]],
                      "num_blocks": 64, "block_size": 16}}


def test_fetch_returns_the_served_payload_exactly(server):
    s = server(PAYLOAD)
    host, port = s.address.split(":")
    got = fetch(host, int(port), timeout_s=2)
    assert got == PAYLOAD and isinstance(got["metadata"], bytes)


def test_server_answers_many_and_concurrent_fetches(server):
    s = server(PAYLOAD)
    port = int(s.address.split(":")[1])
    assert all(fetch("127.0.0.1", port, 2) == PAYLOAD for _ in range(5))
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(fetch("127.0.0.1", port, 5)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == [PAYLOAD] * 8


def test_large_payload_round_trips(server):
    big = {"engine_id": "P", "metadata": bytes(range(256)) * 4096}  # 1 MiB, like many regions
    s = server(big)
    assert fetch("127.0.0.1", int(s.address.split(":")[1]), 5) == big


def test_fetch_from_closed_port_raises_within_timeout():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(HandshakeError, match=f"127.0.0.1:{port}"):
        fetch("127.0.0.1", port, timeout_s=0.3)
    assert time.monotonic() - t0 < 2.0


@pytest.mark.timing
def test_fetch_from_peer_that_never_answers_raises_within_timeout():
    ctx = zmq.Context.instance()
    mute = ctx.socket(zmq.REP)
    mute.setsockopt(zmq.LINGER, 0)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    try:
        t0 = time.monotonic()
        with pytest.raises(HandshakeError, match="within 0.3s"):
            fetch("127.0.0.1", port, timeout_s=0.3)
        assert 0.25 < time.monotonic() - t0 < 2.0
    finally:
        mute.close()


def test_fetch_of_non_msgpack_reply_is_handshake_error():
    ctx = zmq.Context.instance()
    rep = ctx.socket(zmq.REP)
    rep.setsockopt(zmq.LINGER, 0)
    port = rep.bind_to_random_port("tcp://127.0.0.1")

    def answer():
        if rep.poll(3000):
            rep.recv()
            rep.send(b"\xc1 not msgpack")

    th = threading.Thread(target=answer)
    th.start()
    try:
        with pytest.raises(HandshakeError, match="bad handshake payload"):
            fetch("127.0.0.1", port, timeout_s=2)
    finally:
        th.join(5)
        rep.close()


def test_bind_conflict_raises_handshake_error(server):
    s = server(PAYLOAD)
    port = int(s.address.split(":")[1])
    with pytest.raises(HandshakeError, match=f"cannot bind side channel 127.0.0.1:{port}"):
        HandshakeServer("127.0.0.1", port, PAYLOAD)
    assert fetch("127.0.0.1", port, 2) == PAYLOAD  # the original keeps serving


def test_bind_conflict_with_plain_tcp_listener():
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        with pytest.raises(HandshakeError, match="cannot bind"):
            HandshakeServer("127.0.0.1", blocker.getsockname()[1], PAYLOAD)


def test_close_frees_the_port_and_stops_answering():
    port = free_port()
    s = HandshakeServer("127.0.0.1", port, PAYLOAD)
    assert fetch("127.0.0.1", port, 2) == PAYLOAD
    s.close()
    with pytest.raises(HandshakeError):
        fetch("127.0.0.1", port, timeout_s=0.3)
    s2 = HandshakeServer("127.0.0.1", port, {"engine_id": "again"})  # rebinding works
    try:
        assert fetch("127.0.0.1", port, 2) == {"engine_id": "again"}
    finally:
        s2.close()


def test_payload_is_frozen_at_construction(server):
    payload = {"engine_id": "P0", "n": [1]}
    s = server(payload)
    payload["n"].append(2)
    assert fetch("127.0.0.1", int(s.address.split(":")[1]), 2) == {"engine_id": "P0", "n": [1]}


def test_server_survives_a_client_that_vanishes_mid_request(server):
    s = server(PAYLOAD)
    port = int(s.address.split(":")[1])
    ctx = zmq.Context.instance()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(f"tcp://127.0.0.1:{port}")
    req.send(b"hello")
    req.close()  # never reads the reply
    time.sleep(0.1)
    assert fetch("127.0.0.1", port, 2) == PAYLOAD
