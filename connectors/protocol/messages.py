"""NIXL notification messages between engines (msgpack, tagged, versioned by prefix).

Pull:  D -> P  Done        (READ finished, or D will not read: free the blocks once
                            every D rank reading this P rank said so)
Push:  D -> P  Register    (destination blocks of a transfer id, signed)
       P -> D  Wrote       (one P rank's WRITE for a transfer id landed)
       P -> D  Rejected    (P will write nothing (more) for that transfer id)
       D -> P  Abort       (D gave up on / cancelled the transfer id)
"""

from __future__ import annotations

import msgspec

PREFIX = b"kvf1"


class Done(msgspec.Struct, tag="done"):
    req_id: str
    expect: int = 1  # notices this P rank gets for req_id in all (D ranks reading it)


class Register(msgspec.Struct, tag="reg"):
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


class Wrote(msgspec.Struct, tag="wrote"):
    transfer_id: str
    rank: int


class Rejected(msgspec.Struct, tag="reject"):
    transfer_id: str
    reason: str
    rank: int = -1  # the P rank that will write nothing (more); -1: every rank


class Abort(msgspec.Struct, tag="abort"):
    transfer_id: str


Message = Done | Register | Wrote | Rejected | Abort
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
