"""Checking a READ's bytes: the reader compares its blocks' checksums with the source's.

After a READ ends DONE (D pulling P's prefill, P reading D's leased history), the reader
computes the checksums of the blocks it received (memory/checksum.py) and asks the
source's side channel for those of the blocks it read (`SUMS` + the block ids). Equal:
the KV is used. Different, or no answer before the deadline: the blocks are reported
bad and the request recomputes, counted as ``checksum_mismatches`` or
``checksums_unanswered``. A pull's Done (P may free its blocks) is sent only after the
check, so P's blocks cannot change while it runs; a reuse READ's blocks are D's leased
blocks, held for ``lease_free_grace_s`` after P's lease check, longer than the READ and
its check may take.

Which READs are checked: ``kv_checksums`` = ``all``, ``sample`` (the READs whose request
id hashes under ``kv_checksum_fraction``: the same request is checked on every rank) or
``off``. READs of head segments (peers of another TP size) are not checked
(``checksums_unchecked``); neither are transfers where this rank's memory has no
host-side view (Neuron HBM registered as VRAM).

Push WRITEs: D's `Register` asks for a check (the same choice, by D's request id); once
its WRITE ended, P computes its source blocks' checksums (they are still held: P frees
them only after) and sends them in a `Sums` message; D, once every writer's `Wrote` came
(no WRITE can land any more), compares them with its destination blocks' (`Expected`).
Different, an error, or nothing within ``ANSWER_S``: recompute, counted as for a READ.
WRITEs of head segments (P and D of different TP sizes) are not checked.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from typing import Literal

import msgspec

from kvferry.connectors.memory.checksum import BlockSums
from kvferry.connectors.protocol.messages import Sums
from kvferry.connectors.transfer.handshake import SUMS_PREFIX, HandshakeError, PendingReply

SUMS = SUMS_PREFIX
ANSWER_S = 5.0  # the source's answer, at most (it computes on its side-channel thread)

Mode = Literal["off", "sample", "all"]


def wanted(mode: Mode, fraction: float, req_id: str) -> bool:
    """Whether a READ for ``req_id`` is checked (the same answer on every rank)."""
    if mode == "all":
        return True
    if mode == "off":
        return False
    return zlib.crc32(req_id.encode()) < fraction * 2**32


def request(block_ids: Sequence[int]) -> bytes:
    """The side-channel request for the source's checksums of ``block_ids``."""
    return SUMS + msgspec.msgpack.encode(list(block_ids))


def answer(sums: BlockSums, req: bytes) -> bytes:
    """The source's reply (its side-channel thread): checksums, or why not. Never raises."""
    try:
        ids = msgspec.msgpack.decode(req[len(SUMS):], type=list[int])
        return msgspec.msgpack.encode({"ok": True, "sums": sums.sums(ids)})
    except Exception as e:  # a bad request or unreadable memory: the reader recomputes
        return msgspec.msgpack.encode({"ok": False, "error": f"{type(e).__name__}: {e}"})


def compare(theirs: Sequence[int], ours: Sequence[int]) -> str | None:
    """None when every block's checksum matched, else what differed."""
    if list(theirs) == list(ours):
        return None
    wrong = [i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b]
    return (f"mismatch in {len(wrong) + abs(len(theirs) - len(ours))} of {len(ours)} blocks "
            f"(first at {wrong[:1]})")


def source_sums(sums: BlockSums, transfer_id: str, rank: int, block_ids: Sequence[int]) -> Sums:
    """P's `Sums` for a push WRITE that ended: its written blocks' checksums, or why not."""
    try:
        return Sums(transfer_id, rank, sums.sums(block_ids))
    except Exception as e:  # never raises: D recomputes on the error
        return Sums(transfer_id, rank, error=f"{type(e).__name__}: {e}")


class Expected:
    """A push WRITE's check on D: the writer's `messages.Sums`, awaited from when every
    `Wrote` came (`start`) for at most ``ANSWER_S``; it may also come before that."""

    def __init__(self) -> None:
        self.theirs: list[int] | None = None
        self.error = ""
        self.started: float | None = None  # monotonic, when D's blocks were all written

    def given(self, msg: Sums) -> None:
        self.theirs, self.error = list(msg.sums), msg.error

    def start(self, now: float) -> None:
        self.started = now

    def poll(self, ours: Callable[[], list[int]], now: float) -> tuple[bool, str | None]:
        """Like `Check.poll`; ``ours`` computes D's blocks' checksums (may raise)."""
        if self.error:
            return True, f"unanswered: {self.error}"
        if self.theirs is None:
            if self.started is None or now < self.started + ANSWER_S:
                return False, None
            return True, f"unanswered within {ANSWER_S:.0f} s"
        return True, compare(self.theirs, ours())


class Check:
    """One READ's check, started when the READ ended; `poll` it from the transfer thread."""

    def __init__(self, host: str, port: int, remote_block_ids: Sequence[int],
                 local_sums: list[int], now: float) -> None:
        self.local = local_sums
        self.started = now  # when the READ was seen DONE: what the check adds runs from here
        self.deadline = now + ANSWER_S
        self._pending: PendingReply | None = None
        self._early: str | None = None
        try:
            self._pending = PendingReply(host, port, request(remote_block_ids), "checksums")
        except HandshakeError as e:
            self._early = f"unanswered: {e}"

    def poll(self, now: float | None = None) -> tuple[bool, str | None]:
        """(ended, why not equal): (False, None) while the source has not answered; (True,
        None) when every block's checksum matched; (True, reason) otherwise."""
        if self._pending is None:
            return True, self._early
        try:
            blob = self._pending.poll()
        except HandshakeError as e:
            return self._end(f"unanswered: {e}")
        if blob is None:
            if (time.monotonic() if now is None else now) < self.deadline:
                return False, None
            return self._end(f"unanswered within {ANSWER_S:.0f} s")
        try:
            reply = msgspec.msgpack.decode(blob)
            if not reply.get("ok"):
                return self._end(f"unanswered: {reply.get('error')}")
            theirs = [int(v) for v in reply["sums"]]
        except (msgspec.DecodeError, AttributeError, KeyError, TypeError, ValueError) as e:
            return self._end(f"unanswered: bad reply ({e})")
        return self._end(compare(theirs, self.local))

    def _end(self, why: str | None) -> tuple[bool, str | None]:
        self.close()
        self._early = why
        return True, why

    def close(self) -> None:
        if self._pending is not None:
            self._pending.close()
            self._pending = None
