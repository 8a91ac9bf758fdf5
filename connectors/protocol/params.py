"""kv_transfer_params: the only data that crosses the router between P and D.

P returns a `RemotePrefill` offer after prefill; the router hands it to D unchanged.
The offer is signed with a deployment secret (HMAC-SHA256) so D reads only block ids
that a P of this deployment published: a client that talks to D directly cannot make it
read someone else's blocks. A malformed, unsigned or mismatching offer is rejected with a
reason, and D recomputes locally.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import msgspec

SECRET_ENV = "KVFERRY_SECRET"
SIG = "kvferry_sig"
S = TypeVar("S", bound=msgspec.Struct)


class InvalidParams(ValueError):
    """kv_transfer_params that must not drive a transfer."""


class RemotePrefill(msgspec.Struct, forbid_unknown_fields=False):
    """P's offer: where the prompt's KV lives and how to fetch it."""

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


def _mac(obj: msgspec.Struct, key: bytes) -> str:
    """MAC over a struct's own fields only (vLLM adds keys of its own on the way)."""
    body = {k: v for k, v in msgspec.to_builtins(obj).items() if k != "sig"}
    return hmac.new(key, msgspec.json.encode(body, order="sorted"), hashlib.sha256).hexdigest()


def struct_sig(obj: msgspec.Struct) -> str:
    """Signature of a message between engines of this deployment (see messages.Register)."""
    return _mac(obj, secret())


def struct_sig_ok(obj: msgspec.Struct, sig: str) -> bool:
    return hmac.compare_digest(sig, _mac(obj, secret()))


def sign(offer: RemotePrefill, key: bytes | None = None) -> dict[str, Any]:
    body = msgspec.to_builtins(offer)
    body[SIG] = _mac(offer, secret() if key is None else key)
    return body


def parse_offer(params: Mapping[str, Any], key: bytes | None = None) -> RemotePrefill:
    """Validate D's incoming params; raises InvalidParams with the reason."""
    if not isinstance(params, Mapping):
        raise InvalidParams(f"kv_transfer_params must be an object, got {type(params).__name__}")
    sig = params.get(SIG)
    if not isinstance(sig, str) or len(sig) != 64 or not sig.isascii():
        raise InvalidParams("offer is not signed by a kvferry prefill engine (bad signature)")
    k = secret() if key is None else key
    if not k:
        raise InvalidParams(f"{SECRET_ENV} is not set on this engine: offers cannot be verified")
    offer = _verified(params, RemotePrefill, sig, k, "offer")
    if any(b < 0 for b in offer.remote_block_ids):
        raise InvalidParams("negative block id in offer")
    if offer.remote_tp_size < 1 or not 0 < offer.remote_port < 65536:
        raise InvalidParams("offer has an invalid tp size or port")
    return offer


def _verified(params: Mapping[str, Any], cls: type[S], sig: str, key: bytes, what: str) -> S:
    """The struct's own fields of ``params``, type-checked, with a matching MAC."""
    try:
        obj = msgspec.convert({f: v for f, v in params.items() if f in cls.__struct_fields__}, cls)
    except msgspec.ValidationError as e:
        raise InvalidParams(f"malformed {what}: {e}") from e
    if not hmac.compare_digest(sig, _mac(obj, key)):
        raise InvalidParams(f"{what} signature does not match (tampered or another deployment)")
    return obj


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class LeaseOffer(msgspec.Struct, forbid_unknown_fields=False):
    """D's lease on a finished turn's KV: what P may READ on the next turn.

    Signed like `RemotePrefill` (the router relays it; a client can never choose blocks).
    ``instance`` is D's boot id: a restarted D (same engine id, other blocks) is refused.
    ``expiry`` is wall-clock (``time.time()``) on D.
    """

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


def sign_lease(offer: LeaseOffer, key: bytes | None = None) -> dict[str, Any]:
    body = msgspec.to_builtins(offer)
    body[SIG] = _mac(offer, secret() if key is None else key)
    return body


def parse_lease(params: Any, key: bytes | None = None) -> LeaseOffer:
    """Validate a relayed lease offer; raises InvalidParams with the reason."""
    if not isinstance(params, Mapping):
        raise InvalidParams("reuse offer must be an object")
    sig = params.get(SIG)
    k = secret() if key is None else key
    if not k:
        raise InvalidParams(f"{SECRET_ENV} is not set on this engine: offers cannot be verified")
    if not isinstance(sig, str) or len(sig) != 64 or not sig.isascii():
        raise InvalidParams("reuse offer is not signed by a kvferry decode engine")
    offer = _verified(params, LeaseOffer, sig, k, "reuse offer")
    if any(b < 0 for b in offer.block_ids) or offer.block_size <= 0 or offer.num_tokens < 0:
        raise InvalidParams("reuse offer has negative ids or sizes")
    if offer.tp_size < 1 or not 0 < offer.port < 65536:
        raise InvalidParams("reuse offer has an invalid tp size or port")
    return offer


class KvParams(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    """The kvferry keys of one request's kv_transfer_params, as the router sends each leg.

    P leg: ``do_remote_decode`` (keep the KV for a decode engine), with ``push`` and
    ``transfer_id``, and ``reuse`` (D's signed lease offer, relayed) on a later turn.
    D leg: ``do_remote_prefill`` with P's signed `RemotePrefill` (pull) or ``push``,
    ``transfer_id``, ``remote_host``/``remote_port`` (P's side channel), and ``lease``
    (``{"lease_id", "ttl"}``: keep this turn's KV). Other keys (the offer's) pass by.
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    push: bool = False
    transfer_id: str = ""
    remote_host: str = ""
    remote_port: int = 0
    reuse: Any = None  # checked by parse_lease where it is used
    lease: Any = None  # checked by the lease keeper where it is used


def kv_params(params: Any) -> KvParams:
    """The request's kvferry keys; all defaults (nothing to transfer) when there are none.
    Raises InvalidParams for keys of the wrong type."""
    if not params:
        return KvParams()
    if not isinstance(params, Mapping):
        raise InvalidParams(f"kv_transfer_params must be an object, got {type(params).__name__}")
    try:
        return msgspec.convert({k: v for k, v in params.items() if k in KvParams.__struct_fields__},
                               KvParams)
    except msgspec.ValidationError as e:
        raise InvalidParams(f"malformed kv_transfer_params: {e}") from e


class ReuseReport(msgspec.Struct):
    """What P's reuse of D's KV did for one request, in P's returned kv_transfer_params."""

    reused_tokens: int = 0
    reuse_reason: str = ""
