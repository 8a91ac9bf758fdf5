"""NIXL notification messages between engines (msgpack, tagged, versioned by prefix).

Register is signed with the deployment's one MAC (`params.mac`).

Pull:  D -> P  Done        (READ finished, or D will not read: free the blocks once
                            every D rank reading this P rank said so)
Push:  D -> P  Register    (destination blocks of a transfer id, signed)
       P -> D  Wrote       (one P rank's WRITE for a transfer id landed)
       P -> D  Sums        (its source blocks' checksums, when D's Register asked)
       P -> D  Rejected    (P will write nothing (more) for that transfer id)
       D -> P  Abort       (D gave up on / cancelled the transfer id)
"""

from __future__ import annotations

import msgspec

from kvferry.connectors.protocol.params import PROTOCOL_VERSION

PREFIX = b"kvf%d" % PROTOCOL_VERSION  # another version's notifications are not ours


class Done(msgspec.Struct, tag="done"):
    """D -> P (pull): D's READ of ``req_id`` ended; P frees the blocks once all the
    D ranks that read them said so."""

    req_id: str
    expect: int = 1  # notices this P rank gets for req_id in all (D ranks reading it)


class Register(msgspec.Struct, tag="reg"):
    """D -> P (push): where P WRITEs ``transfer_id``'s KV (D's blocks for the tokens
    from ``first_token``). Signed (``sig``): P writes only into memory a kvferry D that
    holds the shared secret registered."""

    transfer_id: str
    engine_id: str
    host: str
    port: int
    rank: int
    block_ids: list[int]
    block_size: int
    num_blocks: int
    first_token: int
    num_tokens: int
    prompt_hash: str
    sig: str = ""
    tp_size: int = 1  # D's: P writes head segments to D's ranks when its own differs
    checksums: bool = False  # P sends `Sums` of its source blocks once its WRITE ended


class Wrote(msgspec.Struct, tag="wrote"):
    """P -> D (push): P rank ``rank``'s WRITE of ``transfer_id`` is complete (sent after
    its data)."""

    transfer_id: str
    rank: int


class Sums(msgspec.Struct, tag="sums"):
    """P -> D (push, when the Register asked): the checksums of the blocks P rank ``rank``
    wrote, in D's block order, computed once its WRITE ended (memory/checksum.py); or why
    they could not be computed (``error``). D compares them with its own blocks'."""

    transfer_id: str
    rank: int
    sums: list[int] = []
    error: str = ""


class Rejected(msgspec.Struct, tag="reject"):
    """P -> D (push): the registration will not be served and no (further) WRITE lands:
    D recomputes at once instead of waiting for its timeout."""

    transfer_id: str
    reason: str
    rank: int = -1  # the P rank that will write nothing (more); -1: every rank


class Abort(msgspec.Struct, tag="abort"):
    """D -> P (push): D gave up on ``transfer_id``: P writes nothing and frees the prefill."""

    transfer_id: str


Message = Done | Register | Wrote | Sums | Rejected | Abort


class Hello(msgspec.Struct, forbid_unknown_fields=False):
    """What each engine rank's side channel answers (transfer/handshake.py): who it is and
    how to reach its KV. A peer of another `PROTOCOL_VERSION` is refused at the handshake."""

    engine_id: str
    rank: int
    metadata: bytes  # the rank's NIXL agent metadata
    layout: dict  # memory.backends.KVLayout.to_wire()
    tp_size: int = 1
    instance: str = ""  # boot id: a restarted engine is another instance
    protocol: int = 0
    nixl_backends: list[str] = []  # the backends this rank's agent really created
_dec = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return PREFIX + msgspec.msgpack.encode(msg)


def decode(blob: bytes) -> Message | None:
    """The message, or None for anything that is not a well-formed kvferry message."""
    if not blob.startswith(PREFIX):
        return None
    try:
        return _dec.decode(blob[len(PREFIX):])
    except msgspec.DecodeError:
        return None
