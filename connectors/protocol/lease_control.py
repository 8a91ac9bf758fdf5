"""Lease-control wire format: the router's request to renew, release or look up one of D's
leases, its checks, and the replies.

Requests are signed with the deployment secret (the one MAC, `params.mac`) and
time-stamped, so only the router (or another holder of ``KVFERRY_SECRET``) can end or
extend a lease, and a captured request cannot be replayed later. Replies:
``{"ok": True, "offer": <signed LeaseOffer>}`` or ``{"ok": False, "error": "<reason>"}``
where reason is a `LeaseError` reason, one of `Refused`'s, or ``unreachable``. Pure: D's
server is connectors/transfer/lease_control.py, the router's client router/conversations/lease_control.py.
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal, TypeVar

import msgspec

from kvferry.connectors.protocol.params import mac, mac_ok

_Signed = TypeVar("_Signed", bound=msgspec.Struct)

# "info": the router looks a lease up; "check": a P about to READ the lease's blocks asks
# that it still holds (D then keeps them a grace longer than that READ may run).
Op = Literal["renew", "release", "info", "check"]
OPS: tuple[str, ...] = ("renew", "release", "info", "check")
MAX_SKEW_S = 300.0


class LeaseControl(msgspec.Struct):
    """One request of the router to D, signed with the deployment's MAC (`params.mac`)."""

    op: Op
    lease_id: str
    ts: float  # the router's wall clock: D refuses requests older or newer than MAX_SKEW_S
    ttl: float | None = None
    sig: str = ""


class Refused(ValueError):
    """A request D does not act on; ``reason`` is the reply's error."""

    def __init__(self, reason: Literal["bad_request", "bad_signature", "stale"]) -> None:
        super().__init__(reason)
        self.reason = reason


_decoder = msgspec.msgpack.Decoder(LeaseControl)


def request(op: str, lease_id: str, ttl: float | None = None, key: bytes | None = None) -> bytes:
    """The signed, time-stamped request (``key``: the deployment secret by default)."""
    if op not in OPS:
        raise ValueError(f"unknown lease op {op!r}")
    # floats on the wire: the MAC covers the decoded (float) values
    req = LeaseControl(op, lease_id, time.time(), None if ttl is None else float(ttl))  # type: ignore[arg-type]
    req.sig = mac(req, key)
    return msgspec.msgpack.encode(req)


def parse(blob: bytes, key: bytes | None = None, now: float | None = None) -> LeaseControl:
    """The request in ``blob`` if it is well formed, signed with ``key`` and no more than
    MAX_SKEW_S away from ``now`` (this host's wall clock); else `Refused`, checked in
    that order. Never raises anything else."""
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
        raise Refused("bad_request") from None
    return authentic(req, key, now)


def authentic(req: _Signed, key: bytes | None, now: float | None) -> _Signed:
    """``req`` if its ``sig`` is ``key``'s MAC of it and its ``ts`` is no more than
    MAX_SKEW_S from ``now``; else `Refused`. Shared by every signed side-channel request."""
    if not mac_ok(req, req.sig, key):
        raise Refused("bad_signature")
    if abs((time.time() if now is None else now) - req.ts) > MAX_SKEW_S:
        raise Refused("stale")
    return req


def unreachable(detail: str = "") -> dict[str, Any]:
    """The reply a caller gets when D did not answer (in time): no lease was touched."""
    return {"ok": False, "error": f"unreachable: {detail}" if detail else "unreachable"}


def reply(blob: bytes) -> dict[str, Any]:
    """D's reply as the caller sees it: a dict, or ``bad_reply``."""
    try:
        out = msgspec.msgpack.decode(blob)
    except msgspec.DecodeError as e:
        return unreachable(str(e))
    return out if isinstance(out, dict) else {"ok": False, "error": "bad_reply"}
