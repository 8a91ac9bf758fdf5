"""Side channel for the agent-metadata handshake (ZMQ REQ/REP).

Each engine rank serves one small, immutable blob: its NIXL agent metadata and KV
layout. A peer fetches it once per (engine, rank) before its first transfer; the reply
is cached by the caller. Every fetch has a deadline so a dead peer is an error, never a
hang.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

log = logging.getLogger("vllm." + __name__)  # under vLLM's handlers


class HandshakeError(RuntimeError):
    pass


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


class HandshakeServer(ReplyServer):
    """Answers every request with the same payload (agent metadata and KV layout)."""

    def __init__(self, host: str, port: int, payload: dict[str, Any]):
        blob = msgspec.msgpack.encode(payload)
        super().__init__(host, port, lambda _req: blob, "side channel")


def fetch(host: str, port: int, timeout_s: float = 5.0) -> dict[str, Any]:
    """The peer's payload, or HandshakeError after ``timeout_s``."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(b"hello")
        blob = sock.recv()
    except zmq.ZMQError as e:
        raise HandshakeError(f"no handshake from {host}:{port} within {timeout_s}s: {e}") from e
    finally:
        sock.close()
    try:
        return msgspec.msgpack.decode(blob)
    except msgspec.DecodeError as e:
        raise HandshakeError(f"bad handshake payload from {host}:{port}: {e}") from e
