"""Lease control channel, D's side: a decode engine's scheduler serves the router's renew,
release and info requests from a daemon thread (`ControlServer`, ZMQ REP).

The requests and replies are connectors/protocol/lease_control.py (signed with the
deployment secret, time-stamped); the router's client is router/lease_control.py.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from kvferry.connectors.protocol import lease_control as wire
from kvferry.connectors.protocol.lease import LeaseError
from kvferry.connectors.transfer import faults
from kvferry.connectors.transfer.handshake import HandshakeError, ReplyServer, _request

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
        return {"ok": True, "offer": keeper.info(lease_id)}
    except LeaseError as e:
        return {"ok": False, "error": str(e.reason)}
    except Exception as e:  # a bug must not kill the channel
        log.exception("lease control %s %s", op, lease_id)
        return {"ok": False, "error": f"internal: {e}"}


def lease_holds(host: str, port: int, lease_id: str, timeout_s: float) -> str | None:
    """P, just before READing a lease's blocks: None if D still holds the lease, else why
    not. Sound with D's grace: D answered "held" at t, so it frees those blocks no sooner
    than t + lease_free_grace_s, after P's READ ends (reuse_read_timeout_s is shorter)."""
    try:
        reply = msgspec.msgpack.decode(_request(host, port, wire.request("info", lease_id),
                                                timeout_s, "lease info"))
    except (HandshakeError, msgspec.DecodeError) as e:
        return f"lease control unreachable: {e}"
    if isinstance(reply, dict) and reply.get("ok") is True:
        return None
    return str(reply.get("error") if isinstance(reply, dict) else "bad reply")


class ControlServer(ReplyServer):
    """Serves `handle` for one keeper from a daemon thread."""

    def __init__(self, keeper: Any, host: str, port: int) -> None:
        self.keeper = keeper
        super().__init__(host, port, lambda blob: msgspec.msgpack.encode(handle(self.keeper, blob)),
                         "lease control")
