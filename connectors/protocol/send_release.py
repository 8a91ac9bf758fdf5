"""Pull: the router tells P that no decode will READ an offer's blocks (D refused or failed
the request), so P frees them now instead of after ``send_timeout_s``.

Sent to each of P's ranks on its side channel (the offer's ``remote_host``,
``remote_port`` + rank), where only requests starting with `PREFIX` are these. Signed with
the deployment secret (the one MAC, `params.mac`) and time-stamped like lease control: only
the router (or another holder of ``KVFERRY_SECRET``) can free P's blocks, and a captured
request cannot be replayed later. Replies: ``{"ok": True}`` or ``{"ok": False, "error":
<lease_control.Refused reason>}``. Pure: P's server is connectors/transfer/handshake.py,
the router's client router/legs/offer_release.py.
"""

from __future__ import annotations

import math
import time
from typing import Any

import msgspec

from kvferry.connectors.protocol.lease_control import Refused, authentic
from kvferry.connectors.protocol.params import PROTOCOL_VERSION, SIG, mac

PREFIX = b"kvf%d-release-send" % PROTOCOL_VERSION


class ReleaseSend(msgspec.Struct):
    """Free the blocks P keeps for its request ``req_id`` (pull: an offer's
    remote_request_id), or, push, those it holds for ``transfer_id``: P acts as on D's own
    `messages.Abort` (blocks under a WRITE go when it ends)."""

    req_id: str
    ts: float  # the router's wall clock: P refuses requests older or newer than MAX_SKEW_S
    sig: str = ""
    transfer_id: str = ""


_decoder = msgspec.msgpack.Decoder(ReleaseSend)


def releasable(offer: Any) -> tuple[str, int, int, str] | None:
    """(host, port, tp_size, req_id) of a kvferry pull offer (signed kv_transfer_params
    from P), or None for anything else (no offer, or another connector's)."""
    if not isinstance(offer, dict) or SIG not in offer:
        return None
    host, port, tp, req_id = (offer.get(k) for k in (
        "remote_host", "remote_port", "remote_tp_size", "remote_request_id"))
    if not (isinstance(host, str) and host and isinstance(req_id, str) and req_id
            and isinstance(port, int) and 0 < port < 65536):
        return None
    return host, port, tp if isinstance(tp, int) and tp > 0 else 1, req_id


def request(req_id: str, key: bytes | None = None, transfer_id: str = "") -> bytes:
    """The signed, time-stamped request (``key``: the deployment secret by default)."""
    req = ReleaseSend(req_id, time.time(), transfer_id=transfer_id)
    req.sig = mac(req, key)
    return PREFIX + msgspec.msgpack.encode(req)


def parse(blob: bytes, key: bytes | None = None, now: float | None = None) -> ReleaseSend:
    """The request in ``blob`` if well formed, signed with ``key`` and no more than
    MAX_SKEW_S from ``now``; else `Refused`. Never raises anything else."""
    try:
        if not blob.startswith(PREFIX):
            raise ValueError("not a release")
        req = _decoder.decode(blob[len(PREFIX):])
        if not req.sig.isascii() or not math.isfinite(req.ts):
            raise ValueError("bad field")
    except Exception:
        raise Refused("bad_request") from None
    return authentic(req, key, now)


def reply(ok: bool, error: str = "") -> bytes:
    return msgspec.msgpack.encode({"ok": True} if ok else {"ok": False, "error": error})
