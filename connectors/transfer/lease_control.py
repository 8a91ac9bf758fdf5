"""Lease control channel, D's side: a decode engine's scheduler serves the router's renew,
release and info requests from a daemon thread (`ControlServer`, ZMQ REP).

The requests and replies are connectors/protocol/lease_control.py (signed with the
deployment secret, time-stamped); the router's client is router/conversations/lease_control.py.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from kvferry.connectors.protocol import lease_control as wire
from kvferry.connectors.protocol.lease import LeaseError
from kvferry.connectors.transfer import faults
from kvferry.connectors.transfer.handshake import HandshakeError, PendingReply, ReplyServer

log = logging.getLogger("vllm." + __name__)


def handle(keeper: Any, blob: bytes, key: bytes | None = None, now: float | None = None) -> dict[str, Any]:
    """One request against a `LeaseKeeper`; never raises."""
    if faults.ACTIVE and faults.lost("lease_handle"): return faults.unreachable()  # noqa: E701
    try:
        req = wire.parse(blob, key, now)
    except wire.Refused as e:
        return {"ok": False, "error": e.reason}
    op, lease_id = req.op, req.lease_id
    try:
        if op == "renew":
            return {"ok": True, "offer": keeper.renew(lease_id, req.ttl)}
        if op == "release":
            keeper.release(lease_id)
            return {"ok": True}
        return {"ok": True, "offer": keeper.info(lease_id, for_read=op == "check")}
    except LeaseError as e:
        return {"ok": False, "error": str(e.reason)}
    except Exception as e:  # a bug must not kill the channel
        log.exception("lease control %s %s", op, lease_id)
        return {"ok": False, "error": f"internal: {e}"}


class LeaseCheck:
    """P, just before READing a lease's blocks: asks D whether the lease still holds,
    without blocking P's transfer thread (`poll` it). Sound with D's grace: D answered
    "held" at t, so it frees those blocks no sooner than t + lease_free_grace_s, after
    P's READ ends (reuse_read_timeout_s is shorter)."""

    def __init__(self, host: str, port: int, lease_id: str) -> None:
        self._pending: PendingReply | None = None
        self._early: str | None = None
        try:
            self._pending = PendingReply(host, port, wire.request("check", lease_id),
                                         "lease check")
        except HandshakeError as e:
            self._early = f"lease control unreachable: {e}"

    def poll(self, timeout_s: float = 0.0) -> tuple[bool, str | None]:
        """(answered, why not held): (False, None) while D has not answered; (True, None)
        when the lease holds; (True, reason) when it does not or D's reply was bad."""
        if self._pending is None:
            return True, self._early
        try:
            blob = self._pending.poll(timeout_s)
            if blob is None:
                return False, None
            reply = msgspec.msgpack.decode(blob)
        except (HandshakeError, msgspec.DecodeError) as e:
            self.close()
            self._early = f"lease control unreachable: {e}"
            return True, self._early
        self.close()
        self._early = "bad reply"
        if isinstance(reply, dict):
            self._early = None if reply.get("ok") is True else str(reply.get("error"))
        return True, self._early

    def close(self) -> None:
        if self._pending is not None:
            self._pending.close()
            self._pending = None


class ControlServer(ReplyServer):
    """Serves `handle` for one keeper from a daemon thread."""

    def __init__(self, keeper: Any, host: str, port: int) -> None:
        self.keeper = keeper
        super().__init__(host, port, lambda blob: msgspec.msgpack.encode(handle(self.keeper, blob)),
                         "lease control")
