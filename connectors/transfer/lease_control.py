"""Lease control channel: the router renews, releases and looks up D's leases (ZMQ REQ/REP).

A decode engine's scheduler serves it from a daemon thread (`ControlServer`). Requests are
signed with the deployment secret (the one MAC, `params.mac`) and time-stamped, so only the router (or another
holder of ``KVFERRY_SECRET``) can end or extend a lease, and a captured request cannot be
replayed later. Replies: ``{"ok": True, "offer": <signed LeaseOffer>}`` or
``{"ok": False, "error": "<reason>"}`` where reason is a `LeaseError` reason or
``bad_request``.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Literal

import msgspec
import zmq
import zmq.asyncio

from kvferry.connectors.protocol.lease import LeaseError
from kvferry.connectors.protocol.params import mac, mac_ok
from kvferry.connectors.transfer import faults
from kvferry.connectors.transfer.handshake import ReplyServer

log = logging.getLogger("vllm." + __name__)

Op = Literal["renew", "release", "info"]
OPS: tuple[str, ...] = ("renew", "release", "info")
MAX_SKEW_S = 300.0


class LeaseControl(msgspec.Struct):
    """One request of the router to D, signed with the deployment's MAC (`params.mac`)."""

    op: Op
    lease_id: str
    ts: float  # the router's wall clock: D refuses requests older or newer than MAX_SKEW_S
    ttl: float | None = None
    sig: str = ""


_decoder = msgspec.msgpack.Decoder(LeaseControl)


def request(op: str, lease_id: str, ttl: float | None = None, key: bytes | None = None) -> bytes:
    if op not in OPS:
        raise ValueError(f"unknown lease op {op!r}")
    # floats on the wire: the MAC covers the decoded (float) values
    req = LeaseControl(op, lease_id, time.time(), None if ttl is None else float(ttl))  # type: ignore[arg-type]
    req.sig = mac(req, key)
    return msgspec.msgpack.encode(req)


def handle(keeper: Any, blob: bytes, key: bytes | None = None, now: float | None = None) -> dict[str, Any]:
    """One request against a `LeaseKeeper`; never raises."""
    if faults.ACTIVE and faults.lost("lease_handle"): return faults.unreachable()  # noqa: E701
    try:
        req = _decoder.decode(blob)
        # Finite numbers (a NaN ts would pass the staleness check) are checked here, so
        # nothing below raises.
        if not req.sig.isascii():  # hmac.compare_digest raises on other str
            raise ValueError("bad sig")
        if not math.isfinite(req.ts):
            raise ValueError("bad ts")
        if req.ttl is not None and (not math.isfinite(req.ttl) or req.ttl <= 0):
            raise ValueError("bad ttl")
    except Exception:
        return {"ok": False, "error": "bad_request"}
    if not mac_ok(req, req.sig, key):
        return {"ok": False, "error": "bad_signature"}
    if abs((time.time() if now is None else now) - req.ts) > MAX_SKEW_S:
        return {"ok": False, "error": "stale"}
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


class ControlServer(ReplyServer):
    """Serves `handle` for one keeper from a daemon thread."""

    def __init__(self, keeper: Any, host: str, port: int) -> None:
        self.keeper = keeper
        super().__init__(host, port, lambda blob: msgspec.msgpack.encode(handle(self.keeper, blob)),
                         "lease control")


async def call(host: str, port: int, op: str, lease_id: str, ttl: float | None = None,
               timeout_s: float = 2.0, key: bytes | None = None) -> dict[str, Any]:
    """Router side (asyncio): one request; ``{"ok": False, "error": "unreachable"}`` on timeout."""
    if faults.ACTIVE and await faults.lost_async("lease_call"): return faults.unreachable()  # noqa: E701
    sock = zmq.asyncio.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        await sock.send(request(op, lease_id, ttl, key))
        if not await sock.poll(int(timeout_s * 1000)):
            return {"ok": False, "error": "unreachable"}
        reply = msgspec.msgpack.decode(await sock.recv())
        return reply if isinstance(reply, dict) else {"ok": False, "error": "bad_reply"}
    except (zmq.ZMQError, msgspec.DecodeError) as e:
        return {"ok": False, "error": f"unreachable: {e}"}
    finally:
        sock.close()
