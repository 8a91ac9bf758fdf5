"""Lease control channel: the router renews, releases and looks up D's leases (ZMQ REQ/REP).

A decode engine's scheduler serves it from a daemon thread (`ControlServer`). Requests are
signed with the deployment secret (HMAC) and time-stamped, so only the router (or another
holder of ``KVFERRY_SECRET``) can end or extend a lease, and a captured request cannot be
replayed later. Replies: ``{"ok": True, "offer": <signed LeaseOffer>}`` or
``{"ok": False, "error": "<reason>"}`` where reason is a `LeaseError` reason or
``bad_request``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvferry.connectors.protocol.lease import LeaseError
from kvferry.connectors.protocol.params import secret
from kvferry.connectors.transfer import faults
from kvferry.connectors.transfer.handshake import ReplyServer

log = logging.getLogger("vllm." + __name__)

OPS = ("renew", "release", "info")
MAX_SKEW_S = 300.0


def _mac(op: str, lease_id: str, ttl: float | None, ts: float, key: bytes) -> str:
    return hmac.new(key, msgspec.msgpack.encode([op, lease_id, ttl, ts]), hashlib.sha256).hexdigest()


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def request(op: str, lease_id: str, ttl: float | None = None, key: bytes | None = None) -> bytes:
    if op not in OPS:
        raise ValueError(f"unknown lease op {op!r}")
    ts = time.time()
    sig = _mac(op, lease_id, ttl, ts, secret() if key is None else key)
    return msgspec.msgpack.encode({"op": op, "lease_id": lease_id, "ttl": ttl, "ts": ts, "sig": sig})


def handle(keeper: Any, blob: bytes, key: bytes | None = None, now: float | None = None) -> dict[str, Any]:
    """One request against a `LeaseKeeper`; never raises."""
    if faults.ACTIVE and faults.lost("lease_handle"): return faults.unreachable()  # noqa: E701
    k = secret() if key is None else key
    try:
        req = msgspec.msgpack.decode(blob)
        op, lease_id, ttl, ts, sig = (req["op"], req["lease_id"], req.get("ttl"), req["ts"],
                                      req["sig"])
        # An ASCII sig (compare_digest raises on other str) and finite numbers (a NaN
        # ts would pass the staleness check) are checked here, so nothing below raises.
        if (op not in OPS or not isinstance(lease_id, str) or not isinstance(sig, str)
                or not sig.isascii()):
            raise ValueError("bad fields")
        if not _finite(ts):
            raise ValueError("bad ts")
        if ttl is not None and (not _finite(ttl) or ttl <= 0):
            raise ValueError("bad ttl")
    except Exception:
        return {"ok": False, "error": "bad_request"}
    if not k or not hmac.compare_digest(sig, _mac(op, lease_id, ttl, ts, k)):
        return {"ok": False, "error": "bad_signature"}
    if abs((time.time() if now is None else now) - float(ts)) > MAX_SKEW_S:
        return {"ok": False, "error": "stale"}
    try:
        if op == "renew":
            return {"ok": True, "offer": keeper.renew(lease_id, ttl)}
        if op == "release":
            keeper.release(lease_id)
            return {"ok": True}
        return {"ok": True, "offer": keeper.info(lease_id)}
    except LeaseError as e:
        return {"ok": False, "error": e.reason}
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
