"""Which P rank serves which KV heads of which D rank, when P and D differ in TP size.

With TP size t and H KV heads, rank r holds heads [r*H/t, (r+1)*H/t) when t <= H, and
one head, replicated over t/H ranks, when t > H (vLLM's layout). A D rank needs its own
heads; each of them is taken from exactly one P rank that holds it, spreading replicas
over D ranks so no P rank serves every read. The same plan drives both directions: in
pull the D rank READs these segments, in push exactly these P ranks WRITE them, and D
waits for the notification of every P rank in `writers(d_rank)`. `copies` turns a
segment into byte ranges inside one block, for any memory order of the block's dims
(heads outermost as in HND: one range; tokens outside heads as in NHD, or layers and K/V
outside heads in a cross-layer block: one range per outer index). Pure and exhaustively
tested, down to the bytes. Pull and reuse READ by `plan` (`notified_by`: whom each D rank
releases); push WRITEs by it from every P rank to its `readers`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """``count`` consecutive heads: P rank ``p_rank``'s local heads from ``p_start`` go to
    the D rank's local heads from ``d_start``."""

    p_rank: int
    p_start: int
    d_start: int
    count: int


def heads_of(rank: int, tp: int, num_heads: int) -> range:
    """Global KV heads held by ``rank`` of a TP group of size ``tp``."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside TP size {tp}")
    if tp <= num_heads:
        if num_heads % tp:
            raise ValueError(f"{num_heads} KV heads do not split over TP {tp}")
        n = num_heads // tp
        return range(rank * n, (rank + 1) * n)
    if tp % num_heads:
        raise ValueError(f"TP {tp} is not a multiple of {num_heads} KV heads")
    h = rank // (tp // num_heads)
    return range(h, h + 1)


def plan(num_heads: int, p_tp: int, d_tp: int, d_rank: int) -> list[Segment]:
    """Segments D rank ``d_rank`` needs, in its local head order."""
    want = heads_of(d_rank, d_tp, num_heads)
    segs: list[Segment] = []
    for i, h in enumerate(want):
        holders = [p for p in range(p_tp) if h in heads_of(p, p_tp, num_heads)]
        p = holders[d_rank % len(holders)]
        p_local = h - heads_of(p, p_tp, num_heads).start
        last = segs[-1] if segs else None
        if last and last.p_rank == p and last.p_start + last.count == p_local \
                and last.d_start + last.count == i:
            segs[-1] = Segment(p, last.p_start, last.d_start, last.count + 1)
        else:
            segs.append(Segment(p, p_local, i, 1))
    return segs


def by_rank(segs: list[Segment]) -> dict[int, list[Segment]]:
    """Segments grouped by source rank (one transfer each), in first-seen order."""
    out: dict[int, list[Segment]] = {}
    for s in segs:
        out.setdefault(s.p_rank, []).append(s)
    return out


def writers(num_heads: int, p_tp: int, d_tp: int, d_rank: int) -> set[int]:
    """P ranks whose WRITE completion D rank ``d_rank`` must see before decoding."""
    return {s.p_rank for s in plan(num_heads, p_tp, d_tp, d_rank)}


def readers(num_heads: int, p_tp: int, d_tp: int, p_rank: int) -> set[int]:
    """D ranks that take some of P rank ``p_rank``'s heads."""
    return {d for d in range(d_tp) if p_rank in writers(num_heads, p_tp, d_tp, d)}


def notified_by(num_heads: int, p_tp: int, d_tp: int, d_rank: int) -> dict[int, int]:
    """Pull: P ranks D rank ``d_rank`` tells that it is done with a request's blocks,
    each with how many such notices that P rank gets in all (it frees after the last).
    A P rank no D rank reads (a replica) is told by D rank ``p_rank % d_tp``, so every
    P rank learns when its blocks may go."""
    out: dict[int, int] = {}
    for p in range(p_tp):
        r = readers(num_heads, p_tp, d_tp, p)
        if d_rank in r:
            out[p] = len(r)
        elif not r and p % d_tp == d_rank:
            out[p] = 1
    return out


@dataclass(frozen=True)
class HeadAxis:
    """Where the KV heads sit in one block's bytes: ``outer`` consecutive groups (every dim
    stored outside the heads dim: layers, K/V, tokens in NHD), each of ``num_heads`` heads
    of ``head_bytes`` (everything stored inside it: head_dim, tokens in HND)."""

    outer: int
    num_heads: int
    head_bytes: int

    @classmethod
    def of(cls, sizes: tuple[int, ...], heads_dim: int, elem_bytes: int) -> HeadAxis:
        """From a block's dim sizes in memory order (outermost first)."""
        inner = elem_bytes
        for n in sizes[heads_dim + 1:]:
            inner *= n
        outer = 1
        for n in sizes[:heads_dim]:
            outer *= n
        return cls(outer, sizes[heads_dim], inner)

    @property
    def block_bytes(self) -> int:
        return self.outer * self.num_heads * self.head_bytes

    def ranges(self, start: int, count: int, merge: bool = True) -> list[tuple[int, int]]:
        """(offset, length) in the block of local heads [start, start + count); all heads
        are one range when ``merge``, else one per outer group like any other slice."""
        if not (start >= 0 and count > 0 and start + count <= self.num_heads):
            raise ValueError(f"heads [{start}, {start + count}) outside {self.num_heads}")
        if merge and count == self.num_heads:
            return [(0, self.block_bytes)]
        group = self.num_heads * self.head_bytes
        return [(o * group + start * self.head_bytes, count * self.head_bytes)
                for o in range(self.outer)]


def copies(p: HeadAxis, d: HeadAxis, seg: Segment) -> list[tuple[int, int, int]]:
    """(offset in P's block, offset in D's block, length) that move ``seg``'s heads."""
    if (p.outer, p.head_bytes) != (d.outer, d.head_bytes):
        raise ValueError(f"blocks differ outside the heads: P {p}, D {d}")
    whole = seg.count == p.num_heads == d.num_heads  # same bytes on both sides: one range
    return [(po, do, n) for (po, n), (do, _) in zip(p.ranges(seg.p_start, seg.count, whole),
                                                   d.ranges(seg.d_start, seg.count, whole),
                                                   strict=True)]


@dataclass(frozen=True)
class Ranks:
    """One engine rank's view of the plan: its rank and TP size, and the model's KV heads
    over all ranks (0: unknown, so only peers of our own TP size can be served)."""

    rank: int
    tp_size: int
    num_heads: int = 0

    def _split(self, other_tp: int, other: str) -> None:
        if self.num_heads <= 0:
            raise ValueError(f"{other} TP {other_tp} != ours {self.tp_size} and the model's KV "
                             "heads are unknown")

    def read_plan(self, src_tp: int, src: str) -> list[tuple[int, list[Segment] | None]]:
        """(source rank, head segments or None for whole blocks) of every READ fetching
        our heads: the same rank, whole blocks, when the TP sizes match; else one READ per
        source rank holding some of our heads (`plan`)."""
        if src_tp == self.tp_size:
            return [(self.rank, None)]
        self._split(src_tp, src)
        return list(by_rank(plan(self.num_heads, src_tp, self.tp_size, self.rank)).items())

    def release_plan(self, p_tp: int) -> dict[int, int]:
        """Pull, D: P rank -> how many D ranks' notices it waits for, for the P ranks we
        tell (`notified_by`; just our own rank's peer when the TP sizes match)."""
        if p_tp == self.tp_size:
            return {self.rank: 1}
        self._split(p_tp, "prefill")
        return notified_by(self.num_heads, p_tp, self.tp_size, self.rank)

    def push_targets(self, p_tp: int) -> tuple[set[int], list[int], list[int]]:
        """Push, D: (P ranks whose Wrote we wait for, P ranks we register with, P ranks we
        tell to free at once). Same TP size: our own rank for all. Otherwise each P rank
        hears from one D rank, the lowest it writes to (it writes to all of them: an
        engine's ranks share block ids), and replicas nobody reads from ``p % d_tp``."""
        if p_tp == self.tp_size:
            return {self.rank}, [self.rank], []
        self._split(p_tp, "prefill")
        lead, idle = [], []
        for p in range(p_tp):
            r = readers(self.num_heads, p_tp, self.tp_size, p)
            if r and min(r) == self.rank:
                lead.append(p)
            elif not r and p % self.tp_size == self.rank:
                idle.append(p)
        return writers(self.num_heads, p_tp, self.tp_size, self.rank), lead, idle

    def write_ranks(self, d_tp: int, d_rank: int) -> list[int]:
        """Push, P: the D ranks we WRITE for a registration from D rank ``d_rank``: that
        rank when the TP sizes match, else every D rank taking some of our heads."""
        if d_tp == self.tp_size:
            return [d_rank]
        self._split(d_tp, "decode")
        return sorted(readers(self.num_heads, self.tp_size, d_tp, self.rank))

    def write_segments(self, d_tp: int, d_rank: int) -> list[Segment] | None:
        """Push, P: our head segments D rank ``d_rank`` takes (None: whole blocks)."""
        if d_tp == self.tp_size:
            return None
        return [s for s in plan(self.num_heads, self.tp_size, d_tp, d_rank) if s.p_rank == self.rank]


MAX_TP = 64  # bound on a peer's TP size (it sizes per-rank plans)


def split_problem(num_heads: int, src_tp: int, dst_tp: int) -> str | None:
    """Why ranks of a TP ``dst_tp`` engine cannot each read their heads from the ranks of
    a TP ``src_tp`` one holding them (`plan`), or None when they can."""
    if num_heads <= 0 or src_tp > MAX_TP:
        return "KV heads unknown or TP too large"
    try:
        plan(num_heads, src_tp, dst_tp, 0)
    except ValueError as e:
        return str(e)
    return None
