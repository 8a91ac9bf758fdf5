"""Push protocol, P side: match D's registration with the prefill, in either order.

Push moves transfer set-up off the TTFT path: D registers its destination blocks while P
still computes, and whichever of {registration, prefill done} reaches P second starts the
WRITE. `PushMatcher` is pure (no I/O, no threads, no clocks: time comes in as ``now``)
and returns *actions* the glue carries out, so every ordering can be tested exhaustively;
D's side is `push_receive.PushReceiver`.

Identity. The router mints one ``transfer_id`` per attempt and gives it to both legs. A
retry is a new attempt and therefore a new transfer id, so a stale leg can never match a
newer one. P's own request id is the ``owner`` of a prefill's blocks.

`PushMatcher` guarantees:
- at most one `StartWrite` per transfer id, never for an aborted, timed-out, failed or
  rejected transfer: P checks its remembered ended ids (tombstones) before writing;
- exactly one `FreeBlocks` per accepted ``prefill_done`` (after the write, its failure, a
  hold timeout or an abort); blocks under an in-flight WRITE are freed only when the
  transport reports ``write_done``/``write_failed``, never earlier;
- a second P request (another ``owner``) carrying a transfer id that is live or ended
  gets its blocks freed at once and never touches the first one's transfer;
- a `Reject` to D whenever its registration will not be served, so D recomputes at once
  instead of waiting for its own timeout. A Reject is also P's promise that no (further)
  WRITE for that transfer id will land: the transport must report ``write_failed`` only
  once no rank's WRITE can still complete.

Tombstones (ended ids, `tombstones.Tombstones`) are kept ``tombstone_ttl`` seconds and at
most ``max_tombstones``; the TTL must exceed any plausible delay of a late event, or a
very late duplicate ``prefill_done`` would be taken for a new one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvferry.connectors.protocol.tombstones import End, Ended, Tombstones

HOLD_TIMEOUT_S = 30.0  # push_hold_timeout_s: prefilled blocks wait this long for D
REGISTER_TIMEOUT_S = 120.0  # push_register_timeout_s: a registration waits for the prefill
TOMBSTONE_TTL_S = 600.0


@dataclass(frozen=True)
class Destination:
    """D's registration: where P must write, as D's scheduler allocated it."""

    block_ids: tuple[tuple[int, ...], ...]  # per D TP rank, in token order
    block_size: int  # D's tokens per block (may differ from P's)
    num_blocks: int  # D's KV capacity: every id must lie in [0, num_blocks)
    first_token: int = 0  # D already holds [0, first_token) (its own prefix hit)

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_ids", tuple(tuple(r) for r in self.block_ids))


@dataclass(frozen=True)
class StartWrite:
    """Hand the transfer to P's writer thread (one per transfer id, ever)."""

    transfer_id: str
    src_block_ids: tuple[int, ...]  # P blocks covering [first_token, num_tokens)
    src_block_size: int
    dest_block_ids: tuple[tuple[int, ...], ...]  # per D rank, trimmed to what is written
    first_token: int
    num_tokens: int
    owner: str = ""  # P's engine request id whose blocks are read


@dataclass(frozen=True)
class FreeBlocks:
    """P may free this request's blocks now (emitted once per prefill_done)."""

    transfer_id: str
    block_ids: tuple[int, ...]
    reason: str
    owner: str = ""  # P's engine request id that holds the blocks


@dataclass(frozen=True)
class Reject:
    """Tell D its registration will not be served: recompute; no WRITE will land."""

    transfer_id: str
    reason: str


PushAction = StartWrite | FreeBlocks | Reject


@dataclass
class _Pending:
    dest: Destination | None = None
    registered_at: float = 0.0
    src: tuple[int, ...] | None = None
    num_tokens: int = 0
    prefilled_at: float = 0.0
    writing: bool = False
    owner: str = ""
    refused: frozenset[str] = frozenset()  # other owners already freed for this id


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _bad_ids(ids: Sequence[int], num_blocks: int | None) -> str | None:
    for b in ids:
        if not isinstance(b, int) or isinstance(b, bool):
            return f"non-integer block id {b!r}"
        if b < 0 or (num_blocks is not None and b >= num_blocks):
            return f"block id {b} outside [0, {num_blocks})"
    return None


def validate_destination(dest: Destination) -> str | None:
    """Why ``dest`` can never be written to, or None. Checks what needs no token count."""
    if dest.block_size <= 0:
        return f"bad block_size {dest.block_size}"
    if dest.num_blocks <= 0:
        return f"bad num_blocks {dest.num_blocks}"
    if not dest.block_ids:
        return "no destination ranks"
    if dest.first_token < 0 or dest.first_token % dest.block_size:
        return f"first_token {dest.first_token} not a multiple of block_size {dest.block_size}"
    for rank, ids in enumerate(dest.block_ids):
        if (why := _bad_ids(ids, dest.num_blocks)) is not None:
            return f"rank {rank}: {why}"
    return None


class PushMatcher:
    """P side: matches D's registration with prefill completion, in either order."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int | None = None,
        *,
        hold_timeout: float = HOLD_TIMEOUT_S,
        register_timeout: float = REGISTER_TIMEOUT_S,
        tombstone_ttl: float = TOMBSTONE_TTL_S,
        max_tombstones: int = 100_000,
    ) -> None:
        """``hold_timeout``: how long prefilled blocks wait for D's registration;
        ``register_timeout``: how long a registration waits for prefill (queueing + a long
        prompt, so longer)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.hold_timeout = hold_timeout
        self.register_timeout = register_timeout
        self._live: dict[str, _Pending] = {}
        self._ended = Tombstones(tombstone_ttl, max_tombstones)
        self._now = -math.inf  # latest time seen; stamps tombstones of clockless events

    # -- events ---------------------------------------------------------------------

    def registered(self, transfer_id: str, dest: Destination, now: float
                   ) -> list[PushAction]:
        """D registered destination blocks for ``transfer_id``."""
        self._seen(now)
        if (ended := self._ended.get(transfer_id)) is not None:
            if ended.reason is End.DONE:
                return []  # duplicate of a served registration
            return [Reject(transfer_id, f"transfer {ended.reason}")]
        p = self._live.get(transfer_id)
        if p is not None and p.dest is not None:
            return []  # duplicate registration: the first one stands
        if (why := validate_destination(dest)) is not None:
            out: list[PushAction] = [
                Reject(transfer_id, f"invalid registration: {why}")]
            if p is not None:  # holding prefilled blocks for this attempt: give them up
                out += self._end(transfer_id, End.INVALID, "invalid registration")
            else:
                self._ended.add(transfer_id, Ended(End.INVALID, self._now))
            return out
        if p is None:
            self._live[transfer_id] = _Pending(dest=dest, registered_at=now)
            return []
        p.dest, p.registered_at = dest, now
        return self._match(transfer_id, p)

    def prefill_done(self, transfer_id: str, block_ids: Sequence[int],
                     num_tokens: int, now: float, owner: str = "") -> list[PushAction]:
        """P finished prefill; its blocks ``block_ids`` (token order) hold ``num_tokens``.

        ``owner`` is P's own request id. The same owner twice is a duplicate event; another
        owner with a transfer id already in use (a client replaying parameters) is refused
        by freeing its blocks at once."""
        self._seen(now)
        src = tuple(block_ids)
        if (ended := self._ended.get(transfer_id)) is not None:
            if owner in ended.owners:
                return []  # duplicate: these blocks were already freed once
            self._ended.add(transfer_id, Ended(ended.reason, self._now,
                                                ended.owners | {owner}))
            return [FreeBlocks(transfer_id, src, f"transfer {ended.reason}", owner)]
        p = self._live.get(transfer_id)
        if p is not None and p.src is not None:
            if owner == p.owner or owner in p.refused:
                return []  # duplicate completion: no second write, no second free
            p.refused |= {owner}
            return [FreeBlocks(transfer_id, src, "transfer id in use by another request",
                               owner)]
        why = self._bad_prefill(src, num_tokens)
        if p is None:
            p = self._live[transfer_id] = _Pending()
        p.src, p.num_tokens, p.prefilled_at, p.owner = src, num_tokens, now, owner
        if why is not None:
            return self._end(transfer_id, End.INVALID, f"invalid prefill: {why}")
        if p.dest is None:
            return []  # hold until D registers (or hold_timeout)
        return self._match(transfer_id, p)

    def write_done(self, transfer_id: str, now: float | None = None) -> list[PushAction]:
        """Every P rank's WRITE for ``transfer_id`` completed."""
        self._seen(now)
        p = self._live.get(transfer_id)
        if p is None or not p.writing:
            return []
        del self._live[transfer_id]
        self._ended.add(transfer_id, Ended(End.DONE, self._now, p.refused | {p.owner}))
        assert p.src is not None
        return [FreeBlocks(transfer_id, p.src, "written", p.owner)]

    def write_failed(self, transfer_id: str, reason: str, now: float | None = None
                     ) -> list[PushAction]:
        """The WRITE failed and no rank's WRITE can still land."""
        self._seen(now)
        p = self._live.get(transfer_id)
        if p is None or not p.writing:
            return []
        return self._end(transfer_id, End.WRITE_FAILED, f"write failed: {reason}")

    def abort(self, transfer_id: str, now: float | None = None, owner: str | None = None
              ) -> list[PushAction]:
        """This attempt is over: P's request ``owner`` was cancelled, or (owner None) D
        cannot be served. An owner that does not hold the transfer changes nothing."""
        self._seen(now)
        if self._ended.get(transfer_id) is not None:
            return []
        p = self._live.get(transfer_id)
        if p is not None and owner is not None and p.src is not None and p.owner != owner:
            return []
        if p is None:
            # Nothing seen yet: remember, so a late registration is rejected and a late
            # prefill_done frees its blocks at once.
            self._ended.add(transfer_id, Ended(End.ABORTED, self._now))
            return []
        if p.writing:  # NIXL may be reading the blocks: freed when the WRITE ends
            return []
        return self._end(transfer_id, End.ABORTED, "aborted on P")

    def tick(self, now: float) -> list[PushAction]:
        """Time out held prefills and waiting registrations; forget old tombstones."""
        self._seen(now)
        out: list[PushAction] = []
        for tid, p in list(self._live.items()):
            if p.writing:
                continue
            if p.src is not None and now - p.prefilled_at >= self.hold_timeout:
                out += self._end(tid, End.HOLD_TIMEOUT, "no registration from D in time")
            elif p.src is None and now - p.registered_at >= self.register_timeout:
                out += self._end(tid, End.REGISTER_TIMEOUT, "prefill did not finish in time")
        self._ended.sweep(now)
        return out

    # -- inspection -----------------------------------------------------------------

    def state(self, transfer_id: str) -> str:
        """waiting_prefill | holding | writing | ended:<reason> | unknown."""
        if (p := self._live.get(transfer_id)) is not None:
            return "writing" if p.writing else ("holding" if p.src is not None
                                                else "waiting_prefill")
        if (e := self._ended.get(transfer_id)) is not None:
            return f"ended:{e.reason}"
        return "unknown"

    def is_live(self, transfer_id: str) -> bool:
        """Still matched, held or being written (not ended, not unknown)."""
        return transfer_id in self._live

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def num_tombstones(self) -> int:
        return len(self._ended)

    # -- internals ------------------------------------------------------------------

    def _seen(self, now: float | None) -> None:
        if now is not None:
            self._now = max(self._now, now)

    def _bad_prefill(self, src: tuple[int, ...], num_tokens: int) -> str | None:
        if not isinstance(num_tokens, int) or num_tokens <= 0:
            return f"bad num_tokens {num_tokens!r}"
        if (why := _bad_ids(src, self.num_blocks)) is not None:
            return why
        need = _ceil_div(num_tokens, self.block_size)
        if len(src) < need:
            return f"{len(src)} blocks cannot hold {num_tokens} tokens (need {need})"
        return None

    def _match(self, transfer_id: str, p: _Pending) -> list[PushAction]:
        dest, src, n = p.dest, p.src, p.num_tokens
        assert dest is not None and src is not None
        if dest.first_token >= n:
            return self._end(transfer_id, End.INVALID,
                             f"D already holds {dest.first_token} >= {n} tokens")
        need = _ceil_div(n, dest.block_size) - dest.first_token // dest.block_size
        for rank, ids in enumerate(dest.block_ids):
            if len(ids) < need:
                return self._end(transfer_id, End.INVALID,
                                 f"rank {rank}: {len(ids)} destination blocks of "
                                 f"{dest.block_size} tokens cannot hold tokens "
                                 f"[{dest.first_token}, {n}) (need {need})")
        p.writing = True
        lo, hi = dest.first_token // self.block_size, _ceil_div(n, self.block_size)
        return [StartWrite(transfer_id, src[lo:hi], self.block_size,
                           tuple(ids[:need] for ids in dest.block_ids), dest.first_token, n,
                           p.owner)]

    def _end(self, transfer_id: str, reason: End, detail: str
             ) -> list[PushAction]:
        """Finish a live transfer unsuccessfully: free held blocks, reject D's registration."""
        p = self._live.pop(transfer_id)
        out: list[PushAction] = []
        if p.src is not None:
            out.append(FreeBlocks(transfer_id, p.src, detail, p.owner))
        if p.dest is not None:
            out.append(Reject(transfer_id, detail))
        owners = p.refused | {p.owner} if p.src is not None else p.refused
        self._ended.add(transfer_id, Ended(reason, self._now, owners))
        return out
