"""kv_transfer_params: the only data that crosses the router between P and D, typed.

Requests: the router gives each leg `KvParams` (built here: `pull_prefill_params`,
`push_prefill_params`, `push_decode_params`, `reuse_params`, `lease_params`). Answers: P
returns a signed `RemotePrefill` offer after prefill, which the router hands to D
unchanged; D returns a signed `LeaseOffer` on a turn it keeps; P adds a `ReuseReport`.

Everything signed between the engines and the router of one deployment (these offers,
push registrations, lease-control requests) uses one MAC, `mac`: HMAC-SHA256 with the
deployment secret over a struct's own fields, bound to its type and to
`PROTOCOL_VERSION`, so D reads only block ids that a P of this deployment published: a
client that talks to D directly cannot make it read someone else's blocks, and no
signed object passes for another kind or another protocol version. A malformed,
unsigned or mismatching object is rejected with a reason (`InvalidParams`), and D
recomputes locally.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import msgspec

PROTOCOL_VERSION = 1
"""Bump on any incompatible change of a signed format or an engine-to-engine message: a
router and engines of one version talk; across versions every signature fails (and
NIXL notifications are ignored by their prefix), so a mismatch recomputes."""

SECRET_ENV = "KVFERRY_SECRET"
SIG = "kvferry_sig"
S = TypeVar("S", bound=msgspec.Struct)


class InvalidParams(ValueError):
    """kv_transfer_params that must not drive a transfer. ``code`` names the reason for
    callers and tests (one of REASONS); the message is for people."""

    REASONS = ("not_an_object", "unsigned", "no_secret", "malformed", "bad_signature",
               "unusable", "prompt_mismatch", "too_few_blocks", "tp_mismatch",
               "block_size_mismatch", "push_incomplete", "bad_lease_id")

    def __init__(self, message: str, code: str = "malformed") -> None:
        super().__init__(message)
        self.code = code


def secret() -> bytes:
    return os.environ.get(SECRET_ENV, "").encode()


def deployment_secret() -> str:
    """What a launcher gives every engine and the router of one deployment: P signs its
    offers with it, D checks them, and the router signs its lease requests to D.
    $KVFERRY_SECRET when set, else a fresh random one."""
    return os.environ.get(SECRET_ENV) or secrets.token_hex(16)


def prompt_hash(token_ids: Sequence[int]) -> str:
    """Identity of the exact token sequence whose KV is offered."""
    h = hashlib.blake2b(digest_size=16)
    h.update(len(token_ids).to_bytes(8, "little"))
    for t in token_ids:
        h.update(int(t).to_bytes(4, "little", signed=False))
    return h.hexdigest()


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# -- the one MAC --------------------------------------------------------------------------
def mac(obj: msgspec.Struct, key: bytes | None = None) -> str:
    """HMAC-SHA256 (hex) of a struct's own fields but ``sig`` (vLLM adds keys of its own on
    the way; they are not covered), bound to the struct's type and `PROTOCOL_VERSION`.
    ``key``: the deployment secret unless given."""
    body = {k: v for k, v in msgspec.to_builtins(obj).items() if k != "sig"}
    domain = f"kvferry/{PROTOCOL_VERSION}/{type(obj).__name__}\n".encode()
    return hmac.new(secret() if key is None else key,
                    domain + msgspec.json.encode(body, order="sorted"), hashlib.sha256).hexdigest()


def mac_ok(obj: msgspec.Struct, sig: Any, key: bytes | None = None) -> bool:
    """``sig`` is ``obj``'s MAC under a non-empty key (an unset secret verifies nothing)."""
    k = secret() if key is None else key
    return (bool(k) and isinstance(sig, str) and len(sig) == 64 and sig.isascii()
            and hmac.compare_digest(sig, mac(obj, k)))


def sign(obj: msgspec.Struct, key: bytes | None = None) -> dict[str, Any]:
    """A signed struct as kv_transfer_params: its fields plus its MAC under `SIG`."""
    body = msgspec.to_builtins(obj)
    body[SIG] = mac(obj, key)
    return body


class Signed(msgspec.Struct, forbid_unknown_fields=False):
    """A struct that travels in kv_transfer_params signed (`sign`, `verify`)."""

    WHAT: ClassVar[str] = "params"
    SIGNER: ClassVar[str] = "kvferry engine"

    def problem(self) -> str | None:
        """Why a correctly signed instance must still not be used (None: it may)."""
        return None


def verify(params: Any, cls: type[S], key: bytes | None = None) -> S:
    """The ``cls`` in ``params``, type-checked, signed by this deployment and free of
    `Signed.problem`; raises InvalidParams with the reason."""
    what = cls.WHAT
    if not isinstance(params, Mapping):
        raise InvalidParams(f"{what} must be an object, got {type(params).__name__}",
                            "not_an_object")
    sig = params.get(SIG)
    if not isinstance(sig, str) or len(sig) != 64 or not sig.isascii():
        raise InvalidParams(f"{what} is not signed by a {cls.SIGNER} (bad signature)", "unsigned")
    k = secret() if key is None else key
    if not k:
        raise InvalidParams(f"{SECRET_ENV} is not set on this engine: offers cannot be verified",
                            "no_secret")
    try:
        obj = msgspec.convert({f: v for f, v in params.items() if f in cls.__struct_fields__}, cls)
    except msgspec.ValidationError as e:
        raise InvalidParams(f"malformed {what}: {e}") from e
    if not hmac.compare_digest(sig, mac(obj, k)):
        raise InvalidParams(f"{what} signature does not match (tampered or another deployment)",
                            "bad_signature")
    if (why := obj.problem()) is not None:
        raise InvalidParams(f"{what} {why}", "unusable")
    return obj


# -- signed answers -----------------------------------------------------------------------
def _endpoint_problem(tp_size: int, port: int, expiry: float) -> str | None:
    """What both offers must hold of the engine they name and of their expiry."""
    if tp_size < 1 or not 0 < port < 65536:
        return "has an invalid tp size or port"
    if not math.isfinite(expiry):
        return "has a non-finite expiry"
    return None


class RemotePrefill(Signed):
    """P's offer: where the prompt's KV lives and how to fetch it."""

    WHAT: ClassVar[str] = "offer"
    SIGNER: ClassVar[str] = "kvferry prefill engine"

    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: list[int]
    remote_request_id: str
    remote_num_tokens: int
    prompt_hash: str
    remote_tp_size: int = 1
    transfer_id: str = ""
    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    # Wall clock after which P may have freed the blocks (0: no limit): D never starts,
    # nor accepts the end of, a READ past it, so it can never load reused blocks.
    expiry: float = 0.0

    def problem(self) -> str | None:
        if any(b < 0 for b in self.remote_block_ids):
            return "has a negative block id"
        return _endpoint_problem(self.remote_tp_size, self.remote_port, self.expiry)


class LeaseOffer(Signed):
    """D's lease on a finished turn's KV: what P may READ on the next turn.

    Signed like `RemotePrefill` (the router relays it; a client can never choose blocks).
    ``instance`` is D's boot id: a restarted D (same engine id, other blocks) is refused.
    ``expiry`` is wall-clock (``time.time()``) on D.
    """

    WHAT: ClassVar[str] = "reuse offer"
    SIGNER: ClassVar[str] = "kvferry decode engine"

    engine_id: str
    instance: str
    host: str
    port: int
    lease_id: str
    block_ids: list[int]
    block_size: int
    num_tokens: int
    block_hashes: list[str]
    expiry: float
    tp_size: int = 1
    control_port: int = 0  # D's lease control channel (0: config.default_control_port)

    def problem(self) -> str | None:
        if any(b < 0 for b in self.block_ids) or self.block_size <= 0 or self.num_tokens < 0:
            return "has negative ids or sizes"
        return _endpoint_problem(self.tp_size, self.port, self.expiry)


def parse_offer(params: Any, key: bytes | None = None) -> RemotePrefill:
    """D: P's verified offer in the request's params."""
    return verify(params, RemotePrefill, key)


def parse_lease(params: Any, key: bytes | None = None) -> LeaseOffer:
    """P: D's verified lease offer, as the router relayed it."""
    return verify(params, LeaseOffer, key)


sign_lease = sign  # D signs its lease offers like any other struct


class ReuseReport(msgspec.Struct):
    """What P's reuse of D's KV did for one request, in P's returned kv_transfer_params."""

    reused_tokens: int = 0
    reuse_reason: str = ""


REUSE_REPORT_KEYS: tuple[str, ...] = ReuseReport.__struct_fields__


def read_reuse_report(report: Mapping[str, Any]) -> tuple[int, str]:
    """(Reused tokens, reason) from P's report, tolerant of what a P may have sent:
    a count that is no non-negative int is 0, a reason at most 64 characters."""
    n = report.get("reused_tokens")
    return (n if isinstance(n, int) and n >= 0 else 0,
            str(report.get("reuse_reason", "unknown"))[:64])


def answered_lease(answer: Any) -> Any:
    """D's signed lease offer in its answer's kv_transfer_params (None: it kept nothing)."""
    return answer.get("lease") if isinstance(answer, Mapping) else None


# -- requests: what the router sends each leg -----------------------------------------------
class LeaseRequest(msgspec.Struct, omit_defaults=True):
    """D leg: keep this turn's KV under lease ``lease_id`` (for ``ttl`` seconds at most)."""

    lease_id: str
    ttl: float | None = None


class KvParams(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    """The kvferry keys of one request's kv_transfer_params, as the router sends each leg.

    P leg: ``do_remote_decode`` (keep the KV for a decode engine), with ``push`` and
    ``transfer_id``, and ``reuse`` (D's signed lease offer, relayed) on a later turn.
    D leg: ``do_remote_prefill`` with P's signed `RemotePrefill` (pull) or ``push``,
    ``transfer_id``, ``remote_host``/``remote_port`` (P's side channel), and ``lease``
    (a `LeaseRequest`). Other keys (the offer's) pass by.
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    push: bool = False
    transfer_id: str = ""
    remote_host: str = ""
    remote_port: int = 0
    reuse: Any = None  # a LeaseOffer, verified by parse_lease where it is used
    lease: Any = None  # a LeaseRequest, parsed by `lease_request` where it is used


def kv_params(params: Any) -> KvParams:
    """The request's kvferry keys; all defaults (nothing to transfer) when there are none.
    Raises InvalidParams for keys of the wrong type."""
    if not params:
        return KvParams()
    if not isinstance(params, Mapping):
        raise InvalidParams(f"kv_transfer_params must be an object, got {type(params).__name__}",
                            "not_an_object")
    try:
        return msgspec.convert({k: v for k, v in params.items() if k in KvParams.__struct_fields__},
                               KvParams)
    except msgspec.ValidationError as e:
        raise InvalidParams(f"malformed kv_transfer_params: {e}") from e


def lease_request(raw: Any) -> LeaseRequest:
    """The D leg's ``lease`` key: a lease id of 1-128 characters and an optional positive
    TTL (any other TTL means D's own); raises InvalidParams."""
    ttl = raw.get("ttl") if isinstance(raw, Mapping) else None
    if isinstance(ttl, bool) or not isinstance(ttl, int | float | None):
        raw = {**raw, "ttl": None}
    try:
        req = msgspec.convert(raw, LeaseRequest)
    except msgspec.ValidationError as e:
        raise InvalidParams(f"malformed lease request: {e}") from e
    if not 0 < len(req.lease_id) <= 128:
        raise InvalidParams("lease id must have 1-128 characters", "bad_lease_id")
    if req.ttl is not None and not (math.isfinite(req.ttl) and req.ttl > 0):
        req.ttl = None
    return req


def _encode(p: KvParams) -> dict[str, Any]:
    return msgspec.to_builtins(p)


def pull_prefill_params(transfer_id: str) -> dict[str, Any]:
    """P leg, pull: keep the blocks for a remote decode."""
    return _encode(KvParams(do_remote_decode=True, transfer_id=transfer_id))


def push_prefill_params(transfer_id: str) -> dict[str, Any]:
    """P leg, push: WRITE the KV to the D that registers ``transfer_id``."""
    return _encode(KvParams(do_remote_decode=True, push=True, transfer_id=transfer_id))


def push_decode_params(transfer_id: str, host: str, port: int) -> dict[str, Any]:
    """D leg, push: register for ``transfer_id`` with P's side channel at host:port."""
    return _encode(KvParams(do_remote_prefill=True, push=True, transfer_id=transfer_id,
                            remote_host=host, remote_port=port))


def reuse_params(lease_offer: Mapping[str, Any]) -> dict[str, Any]:
    """P leg, a later turn: D's signed lease offer (the history P may READ back)."""
    return {"reuse": dict(lease_offer)}


def push_answer(transfer_id: str) -> dict[str, Any]:
    """P's answer to a push prefill (D already has, or will get, the KV by WRITE)."""
    return _encode(KvParams(push=True, transfer_id=transfer_id))


def lease_answer(signed_offer: dict[str, Any]) -> dict[str, Any]:
    """D's answer on a turn it keeps: its signed `LeaseOffer`."""
    return {"lease": signed_offer}


def spend_attempts(params: dict[str, Any], reuse_allocated: bool) -> None:
    """One READ attempt per request, in vLLM's own params dict: after a failed READ vLLM
    reschedules the request, which must then recompute instead of asking the same (dead)
    peer again; likewise one reuse READ once its blocks were allocated."""
    if params.get("do_remote_prefill"):
        params["do_remote_prefill"] = False
    if reuse_allocated and params.get("reuse") is not None:
        params["reuse"] = None


def lease_params(lease_id: str, ttl: float | None = None) -> dict[str, Any]:
    """D leg: keep this turn's KV under ``lease_id`` (``ttl``: D's own when None)."""
    return {"lease": msgspec.to_builtins(LeaseRequest(lease_id, float(ttl) if ttl else None))}
