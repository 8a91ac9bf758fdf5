"""The peer engine ranks one rank has met: handshake once, then one NIXL agent per rank.

A peer is reached by engine id (pull offers, reuse) or by address (push registrations
know only P's host and port); either key finds the same remote agent, because loading
its metadata twice would invalidate the transfers in flight to it.
"""

from __future__ import annotations

import logging
import socket
import time

import msgspec

from kvferry.connectors.memory.backends import KVLayout
from kvferry.connectors.protocol import messages
from kvferry.connectors.protocol.params import PROTOCOL_VERSION
from kvferry.connectors.transfer.handshake import HandshakeError, fetch
from kvferry.connectors.transfer.transport import Peer, Transport

log = logging.getLogger("vllm." + __name__)  # under vLLM's handlers


def gone(host: str, port: int) -> bool:
    """Nothing listens at a peer's side channel host:port any more (the connection is
    refused at once): its process is gone. A timeout is no proof and says False."""
    try:
        socket.create_connection((host, port), timeout=0.05).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def peer_key(rank: int, engine_id: str | None = None, host: str = "", port: int = 0) -> str:
    """The transport's key of a peer rank: by engine id when known, else by address."""
    return f"{engine_id}/{rank}" if engine_id else f"{host}:{port}/{rank}"


class Peers:
    """One rank's handshaken peer ranks, found by engine id or by address, each loaded
    into NIXL once."""

    def __init__(self, transport: Transport, rank: int, handshake_timeout_s: float) -> None:
        self.transport = transport
        self.rank = rank  # ours: the default peer rank
        self.handshake_timeout_s = handshake_timeout_s
        self._engine: dict[str, str] = {}  # peer key -> the peer's engine id
        self._instances: dict[str, str] = {}  # peer key -> the peer's boot id
        self._tp: dict[str, int] = {}  # peer key -> the peer engine's TP size

    def at(self, host: str, port: int, engine_id: str | None = None,
           rank: int | None = None) -> tuple[str, Peer]:
        """(engine id, peer) for TP rank ``rank`` (default: ours) of the engine at
        host:port (cached). ``engine_id`` (when the caller knows it) must match what the
        side channel says."""
        rank = self.rank if rank is None else rank
        key = peer_key(rank, engine_id, host, port)
        peer = self.transport.peer(key)
        if peer is not None:
            return engine_id or self._engine[key], peer
        t0 = time.monotonic()
        hello = self._hello(host, port + rank)
        t1 = time.monotonic()
        found = hello.engine_id
        if engine_id and found != engine_id:
            raise HandshakeError(f"{host}:{port} is engine {found!r}, expected {engine_id!r}")
        if hello.rank != rank:
            raise HandshakeError(f"{host}:{port + rank} serves rank {hello.rank}, not {rank}")
        ekey, akey = peer_key(rank, found), peer_key(rank, None, host, port)
        if self.transport.peer(ekey) is None or self._instances.get(ekey) != hello.instance:
            self.transport.add_peer(ekey, hello.metadata, KVLayout.from_wire(hello.layout))
        log.info("kvferry met %s rank %d at %s:%d: hello %.1f ms, agent added in %.1f ms",
                 found, rank, host, port + rank, (t1 - t0) * 1e3, (time.monotonic() - t1) * 1e3)
        peer = self.transport.alias(akey, ekey)
        for k in (ekey, akey):
            self._engine[k] = found
            self._instances[k] = hello.instance
            self._tp[k] = hello.tp_size
        return found, peer

    def _hello(self, host: str, port: int) -> messages.Hello:
        """The side channel's answer at host:port, typed; HandshakeError if it is not one
        of this protocol version."""
        info = fetch(host, port, self.handshake_timeout_s)
        try:
            hello = msgspec.convert(info, messages.Hello)
        except msgspec.ValidationError as e:
            raise HandshakeError(f"bad handshake from {host}:{port}: {e}") from e
        if hello.protocol != PROTOCOL_VERSION:
            raise HandshakeError(f"{host}:{port} speaks kvferry protocol {hello.protocol}, "
                                 f"this engine {PROTOCOL_VERSION}")
        return hello

    def tp(self, host: str, port: int, engine_id: str | None = None) -> int:
        """TP size of the engine at host:port (asked of its rank 0, which every engine has)."""
        found, _ = self.at(host, port, engine_id, 0)
        return self._tp.get(peer_key(0, found), 1)

    def of_instance(self, host: str, port: int, engine_id: str, rank: int, instance: str) -> Peer:
        """Rank ``rank`` of boot ``instance`` of the engine, met afresh if it restarted
        since; HandshakeError if it did (what the caller wanted of that boot is gone)."""
        key = peer_key(rank, engine_id)
        _, peer = self.at(host, port, engine_id, rank)
        if self._instances.get(key) != instance:
            self.drop(host, port, engine_id, rank)
            _, peer = self.at(host, port, engine_id, rank)
            if self._instances.get(key) != instance:
                raise HandshakeError("the lease belongs to an earlier run of that engine")
        return peer

    def drop(self, host: str, port: int, engine_id: str | None = None,
             rank: int | None = None) -> None:
        """Forget the peer (under every key it is known by): met afresh next time."""
        self.transport.drop_peer(peer_key(self.rank if rank is None else rank, engine_id, host, port))

    def drop_engine(self, engine_id: str, tp_size: int) -> None:
        """Forget every rank of the engine (it may have restarted)."""
        for r in range(tp_size):
            self.transport.drop_peer(peer_key(r, engine_id))

    def send(self, peer: Peer, notif: bytes) -> None:
        """Best effort: every protocol step has a timeout behind a lost notification."""
        try:
            self.transport.notify(peer, notif)
        except Exception as e:
            log.debug("notification to %s: %s", peer.agent_name, e)

    def tell(self, peer: Peer, msg: messages.Message) -> None:
        """`send` one protocol message."""
        self.send(peer, messages.encode(msg))

    def tell_rank(self, host: str, port: int, rank: int, msg: messages.Message,
                  engine_id: str | None = None) -> None:
        """`tell` rank ``rank`` of the engine at host:port, if it can be reached at all."""
        try:
            self.tell(self.at(host, port, engine_id, rank)[1], msg)
        except Exception as e:
            log.debug("cannot reach %s:%d rank %d: %s", host, port, rank, e)
