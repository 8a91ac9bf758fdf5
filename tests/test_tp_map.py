"""TP mapping for every (P TP, D TP) pair up to 8 and every head count that fits, down to
the bytes each segment moves in four block memory orders."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvferry.connectors.protocol.tp_map import (
    HeadAxis,
    Segment,
    copies,
    heads_of,
    notified_by,
    plan,
    readers,
    writers,
)

TPS = range(1, 9)
HEADS = (1, 2, 4, 8, 16)


def valid(h: int, t: int) -> bool:
    return (h % t == 0) if t <= h else (t % h == 0)


CASES = [(h, p, d) for h, p, d in itertools.product(HEADS, TPS, TPS) if valid(h, p) and valid(h, d)]


def test_enough_cases():
    assert len(CASES) > 60


@pytest.mark.parametrize("h,p_tp,d_tp", CASES)
def test_every_d_head_comes_from_one_p_rank_that_holds_it(h, p_tp, d_tp):
    reads = {p: 0 for p in range(p_tp)}
    for d in range(d_tp):
        mine = heads_of(d, d_tp, h)
        got = []
        for s in plan(h, p_tp, d_tp, d):
            held = heads_of(s.p_rank, p_tp, h)
            assert s.p_start >= 0 and s.p_start + s.count <= len(held)
            assert s.d_start >= 0 and s.d_start + s.count <= len(mine)
            for k in range(s.count):
                g = held.start + s.p_start + k
                assert g == mine.start + s.d_start + k, "head mapped to the wrong slot"
                got.append(g)
            reads[s.p_rank] += s.count
        assert got == list(mine), "each D head exactly once, in order"
        assert writers(h, p_tp, d_tp, d) == {s.p_rank for s in plan(h, p_tp, d_tp, d)}
    if p_tp <= h:  # no replicas: every P rank's heads are read by someone
        assert all(n > 0 for n in reads.values())


@pytest.mark.parametrize("h,p_tp,d_tp", CASES)
def test_segments_are_maximal(h, p_tp, d_tp):
    for d in range(d_tp):
        segs = plan(h, p_tp, d_tp, d)
        for a, b in itertools.pairwise(segs):
            assert not (a.p_rank == b.p_rank and a.p_start + a.count == b.p_start
                        and a.d_start + a.count == b.d_start)


def test_examples():
    assert plan(8, 2, 1, 0) == [Segment(0, 0, 0, 4), Segment(1, 0, 4, 4)]  # D gathers from 2
    assert plan(8, 1, 2, 1) == [Segment(0, 4, 0, 4)]  # D rank 1 reads P's upper half
    assert writers(8, 4, 1, 0) == {0, 1, 2, 3}
    # 2 heads over P TP 4: replicas; D TP 2 ranks read different replicas of their head
    assert plan(2, 4, 2, 0) == [Segment(0, 0, 0, 1)] and plan(2, 4, 2, 1) == [Segment(3, 0, 0, 1)]


@pytest.mark.parametrize("h,t", [(8, 3), (2, 3), (6, 4)])
def test_invalid_splits_raise(h, t):
    with pytest.raises(ValueError):
        heads_of(0, t, h)


# -- bytes: copies() moves exactly the planned heads, whatever the block's memory order --

BLOCK = {"layers": 3, "kv": 2, "tokens": 4, "heads": None, "dim": 5}  # heads filled per rank
ORDERS = {  # memory order of one block's dims, outermost first
    "cross_layer_nhd": ("layers", "kv", "tokens", "heads", "dim"),
    "cross_layer_hnd": ("layers", "kv", "heads", "tokens", "dim"),
    "heads_outermost": ("heads", "layers", "kv", "tokens", "dim"),
    "per_layer_nhd": ("tokens", "heads", "dim"),
}
NBLK = 3


def rank_blocks(order: str, heads: range, rng_seed: int) -> tuple[np.ndarray, HeadAxis]:
    """A rank's KV blocks as bytes (NBLK x block), filled from a global array so every head
    of every block has a distinct value; and the rank's HeadAxis."""
    dims = ORDERS[order]
    sizes = tuple(len(heads) if d == "heads" else BLOCK[d] for d in dims)
    full = tuple(16 if d == "heads" else BLOCK[d] for d in dims)
    glob = np.random.default_rng(rng_seed).integers(0, 2**15, (NBLK, *full), dtype=np.int16)
    hd = dims.index("heads")
    local = np.take(glob, list(heads), axis=1 + hd)
    assert local.shape[1:] == sizes
    return np.ascontiguousarray(local).view(np.uint8).reshape(NBLK, -1), HeadAxis.of(sizes, hd, 2)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("h,p_tp,d_tp", [c for c in CASES if c[0] <= 16])
def test_copies_rebuild_every_d_rank_exactly(order, h, p_tp, d_tp):
    seed = 7  # P and D ranks slice the same global tensor
    p_blocks = {}
    for r in range(p_tp):
        p_blocks[r] = rank_blocks(order, heads_of(r, p_tp, h), seed)
    for d in range(d_tp):
        want, d_axis = rank_blocks(order, heads_of(d, d_tp, h), seed)
        got = np.zeros_like(want)
        for seg in plan(h, p_tp, d_tp, d):
            src, p_axis = p_blocks[seg.p_rank]
            for b_p, b_d in ((0, 2), (1, 0), (2, 1)):  # any block ids map block for block
                for po, do, n in copies(p_axis, d_axis, seg):
                    got[b_d, do:do + n] = src[b_p, po:po + n]
        assert np.array_equal(got[[2, 0, 1]], want[[0, 1, 2]]), (order, h, p_tp, d_tp, d)


def test_copies_merge_whole_blocks_and_refuse_mismatches():
    a = HeadAxis(outer=6, num_heads=4, head_bytes=10)
    assert copies(a, a, Segment(0, 0, 0, 4)) == [(0, 0, 240)]
    assert copies(a, HeadAxis(6, 8, 10), Segment(0, 1, 5, 2))[:2] == [(10, 50, 20), (50, 130, 20)]
    with pytest.raises(ValueError):
        copies(a, HeadAxis(6, 8, 12), Segment(0, 0, 0, 1))
    with pytest.raises(ValueError):
        a.ranges(3, 2)


@pytest.mark.parametrize("h,p_tp,d_tp", CASES)
def test_every_p_rank_hears_from_exactly_the_d_ranks_it_expects(h, p_tp, d_tp):
    """Pull release: each P rank gets as many notices as each notice says it will, at
    least one (replicas nobody reads are told too), and only from D ranks that read it
    or from the one D rank that covers an unread replica."""
    heard: dict[int, list[tuple[int, int]]] = {p: [] for p in range(p_tp)}
    for d in range(d_tp):
        for p, expect in notified_by(h, p_tp, d_tp, d).items():
            heard[p].append((d, expect))
        assert writers(h, p_tp, d_tp, d) <= set(notified_by(h, p_tp, d_tp, d))
    for p, got in heard.items():
        assert got, f"P rank {p} never told"
        assert {e for _, e in got} == {len(got)}
        r = readers(h, p_tp, d_tp, p)
        assert {d for d, _ in got} == (r or {p % d_tp})
