"""TP mapping for every (P TP, D TP) pair up to 8 and every head count that fits."""

from __future__ import annotations

import itertools

import pytest

from kvferry.connectors.tp_map import Segment, heads_of, plan, writers

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
