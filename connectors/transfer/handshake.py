"""Side channel for the agent-metadata handshake (ZMQ REQ/REP).

Each engine rank serves one small, immutable blob: its NIXL agent metadata and KV
layout. A peer fetches it once per (engine, rank) before its first transfer; the reply
is cached by the caller. The same socket answers ``b"stats"`` with a live snapshot of the
rank's transfer counters (stats.py), for tests and operators, and the router's signed
`send_release` requests (P frees an offer's blocks no D will read); any other request
(peers send ``b"hello"``) still gets the handshake blob. Every request has a deadline so a dead
peer is an error, never a hang.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from kvferry.connectors.protocol import send_release
from kvferry.connectors.transfer.stats import Snapshot, Stats
from kvferry.connectors.transfer.stats import decode as decode_stats

log = logging.getLogger("vllm." + __name__)  # under vLLM's handlers


class HandshakeError(RuntimeError):
    """A side channel could not bind, or a peer did not answer in time or answered garbage."""


class ReplyServer:
    """A ZMQ REP socket answering each request with ``reply(request)``, from a daemon
    thread; one bad peer never stops it. Shared by the handshake and lease control."""

    def __init__(self, host: str, port: int, reply: Callable[[bytes], bytes], name: str):
        self._reply = reply
        self._sock = zmq.Context.instance().socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            self._sock.close()
            raise HandshakeError(f"cannot bind {name} {host}:{port}: {e}") from e
        self.address = f"{host}:{port}"
        self._name = name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kvferry-{name.replace(' ', '-')}",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(200)):
                continue
            try:
                self._sock.send(self._reply(self._sock.recv()))
            except zmq.ZMQError as e:
                log.warning("%s serve: %s", self._name, e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
        self._sock.close()


STATS = b"stats"
SUMS_PREFIX = b"sums:"  # transfer/verify.py's requests (it imports this module, not back)


class HandshakeServer(ReplyServer):
    """Answers ``b"stats"`` with ``stats``' snapshot (once set: the worker sets it after
    construction) and every other request with the same payload (agent metadata and KV
    layout)."""

    def __init__(self, host: str, port: int, payload: dict[str, Any]):
        blob = msgspec.msgpack.encode(payload)
        self.stats: Stats | None = None
        self.on_release: Callable[[bytes], bytes] | None = None
        """P's answer to the router's `send_release` requests (set by the worker)."""
        self.on_sums: Callable[[bytes], bytes] | None = None
        """The answer to a reader's checksum request (transfer/verify.py; set by the worker)."""
        super().__init__(host, port, lambda req: self._answer(req, blob), "side channel")

    def _answer(self, req: bytes, blob: bytes) -> bytes:
        if req == STATS:
            return (self.stats or Stats()).encode()
        if req.startswith(send_release.PREFIX):
            if self.on_release is None:
                return send_release.reply(False, "unsupported")
            return self.on_release(req)
        if req.startswith(SUMS_PREFIX):
            if self.on_sums is None:
                return msgspec.msgpack.encode({"ok": False, "error": "unsupported"})
            return self.on_sums(req)
        return blob


class PendingReply:
    """One request sent to a `ReplyServer`, its reply collected later without blocking:
    a thread with other work (P's transfer thread) polls it between its other duties."""

    def __init__(self, host: str, port: int, req: bytes, what: str) -> None:
        self.where, self.what = f"{host}:{port}", what
        self._sock = zmq.Context.instance().socket(zmq.REQ)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.connect(f"tcp://{self.where}")
            self._sock.send(req, zmq.NOBLOCK)  # queued until connected (no ZMQ_IMMEDIATE)
        except zmq.ZMQError as e:
            self._sock.close()
            raise HandshakeError(f"cannot ask {self.where} for {what}: {e}") from e

    def poll(self, timeout_s: float = 0.0) -> bytes | None:
        """The reply if it came within ``timeout_s``, else None (ask again later)."""
        try:
            if not self._sock.poll(int(timeout_s * 1000), zmq.POLLIN):
                return None
            return self._sock.recv(zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise HandshakeError(f"no {self.what} from {self.where}: {e}") from e

    def close(self) -> None:
        self._sock.close()


def request(host: str, port: int, req: bytes, timeout_s: float, what: str) -> bytes:
    """One blocking round trip; HandshakeError after ``timeout_s``."""
    pending = PendingReply(host, port, req, what)
    try:
        reply = pending.poll(timeout_s)
    finally:
        pending.close()
    if reply is None:
        raise HandshakeError(f"no {what} from {host}:{port} within {timeout_s}s")
    return reply


def fetch(host: str, port: int, timeout_s: float = 5.0) -> dict[str, Any]:
    """The peer's payload, or HandshakeError after ``timeout_s``."""
    blob = request(host, port, b"hello", timeout_s, "handshake")
    try:
        return msgspec.msgpack.decode(blob)
    except msgspec.DecodeError as e:
        raise HandshakeError(f"bad handshake payload from {host}:{port}: {e}") from e


def fetch_stats(host: str, port: int, timeout_s: float = 5.0) -> Snapshot:
    """The transfer counters of the rank serving host:port, or HandshakeError after
    ``timeout_s`` (or if what answers is no kvferry stats snapshot)."""
    blob = request(host, port, STATS, timeout_s, "stats")
    try:
        return decode_stats(blob)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HandshakeError(f"{host}:{port} answered no stats snapshot: {e}") from e


def fetch_engine_stats(host: str, port: int, tp_size: int = 1, timeout_s: float = 5.0
                       ) -> Snapshot:
    """One engine's counters, summed over its TP ranks (side channel port + rank)."""
    return Snapshot.merge(fetch_stats(host, port + r, timeout_s) for r in range(tp_size))
