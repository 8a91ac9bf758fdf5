"""Block ids -> transfer descriptors (connectors/transfer/layout.py): run merging and address math."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from kvferry.connectors.memory.backends import DRAM, CpuBackend, KVLayout, Plane, Region
from kvferry.connectors.transfer.layout import LayoutMismatch, check_compatible, descriptors, runs


def dense_layout(n: int, bb: int = 64, planes: int = 2, base: int = 10_000, dev: int = 0,
                 block_size: int = 16) -> KVLayout:
    """(2, n, ...) style: each plane is n consecutive blocks of ``bb`` bytes."""
    reg = Region(base, planes * n * bb, dev, DRAM)
    return KVLayout((reg,), tuple(Plane(0, base + i * n * bb, bb, bb, n) for i in range(planes)),
                    n, block_size)


def interleaved_layout(n: int, bb: int = 64, base: int = 50_000) -> KVLayout:
    """(n, 2, ...) style seen as two planes with stride 2*bb (K and V halves of one block)."""
    reg = Region(base, 2 * n * bb, 0, DRAM)
    return KVLayout((reg,), (Plane(0, base, 2 * bb, bb, n), Plane(0, base + bb, 2 * bb, bb, n)), n, 16)


# -- runs --------------------------------------------------------------------------------------
@pytest.mark.parametrize("loc,rem,want", [
    ([], [], []),
    ([5], [9], [(5, 9, 1)]),
    ([1, 2, 3], [7, 8, 9], [(1, 7, 3)]),
    ([1, 2, 3, 7, 8], [4, 5, 6, 0, 1], [(1, 4, 3), (7, 0, 2)]),
    ([1, 2, 3], [7, 8, 10], [(1, 7, 2), (3, 10, 1)]),      # remote breaks the run
    ([1, 2, 4], [7, 8, 9], [(1, 7, 2), (4, 9, 1)]),        # local breaks the run
    ([3, 2, 1], [3, 2, 1], [(1, 1, 3)]),  # descending together: one run (vLLM frees in reverse)
    ([3, 2, 1], [1, 2, 3], [(3, 1, 1), (2, 2, 1), (1, 3, 1)]),  # opposite directions never merge
    ([1, 1, 2], [5, 6, 7], [(1, 5, 1), (1, 6, 2)]),         # duplicate local id
    ([1, 2, 2], [5, 6, 6], [(1, 5, 2), (2, 6, 1)]),         # duplicate pair
    ([4, 5, 0, 1], [0, 1, 2, 3], [(4, 0, 2), (0, 2, 2)]),  # non-monotonic local
])
def test_runs(loc, rem, want):
    assert runs(loc, rem) == want


def test_runs_length_mismatch_raises():
    with pytest.raises(ValueError, match="2 local blocks vs 3 remote"):
        runs([1, 2], [1, 2, 3])


pairs = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=40)


@given(pairs)
@example([(1, 1), (0, 0)])  # a descending run (the case CI once drew)
def test_runs_expand_back_to_the_input_pairs(ps):
    """Every (local, remote) pair survives, each exactly once. A descending run is
    returned by its low end, so order inside it is not kept (a copy does not care)."""
    loc, rem = [a for a, _ in ps], [b for _, b in ps]
    rs = runs(loc, rem)
    expanded = [(ls + i, r0 + i) for ls, r0, n in rs for i in range(n)]
    assert sorted(expanded) == sorted(ps)
    assert all(n >= 1 for *_, n in rs)


@given(st.lists(st.integers(0, 3), max_size=40), st.integers(0, 40), st.integers(0, 40))
def test_runs_of_ascending_pairs_are_maximal(gaps, l0, r0):
    """Ascending input keeps its order, and two adjacent runs could never have been one."""
    loc, rem = [l0], [r0]
    for g in gaps:  # gap 0 on both sides would repeat a block: advance at least one
        loc.append(loc[-1] + 1 + g)
        rem.append(rem[-1] + 1 + (g % 2))
    rs = runs(loc, rem)
    assert [(ls + i, r + i) for ls, r, n in rs for i in range(n)] == list(zip(loc, rem, strict=True))
    for (l1, r1, n1), (l2, r2, _) in zip(rs, rs[1:], strict=False):
        assert not (l2 == l1 + n1 and r2 == r1 + n1)


# -- descriptors: dense ------------------------------------------------------------------------
def test_dense_contiguous_blocks_merge_into_one_descriptor_per_plane():
    loc, rem = dense_layout(8, base=0), dense_layout(8, base=100_000, dev=3)
    ld, rd = descriptors(loc, rem, [2, 3, 4], [5, 6, 7])
    assert ld.dtype == np.uint64 and ld.shape == rd.shape == (2, 3)
    assert ld.tolist() == [[2 * 64, 3 * 64, 0], [8 * 64 + 2 * 64, 3 * 64, 0]]
    assert rd.tolist() == [[100_000 + 5 * 64, 192, 3], [100_000 + 8 * 64 + 5 * 64, 192, 3]]


def test_dense_two_runs_two_planes_four_descriptors_plane_major():
    loc, rem = dense_layout(10, base=0), dense_layout(10, base=0)
    ld, rd = descriptors(loc, rem, [0, 1, 7], [3, 4, 9])
    assert ld[:, 0].tolist() == [0, 7 * 64, 640, 640 + 7 * 64]
    assert ld[:, 1].tolist() == [128, 64, 128, 64]
    assert rd[:, 0].tolist() == [3 * 64, 9 * 64, 640 + 3 * 64, 640 + 9 * 64]
    assert (ld[:, 1] == rd[:, 1]).all()


def test_merge_false_keeps_one_descriptor_per_block_with_same_bytes():
    loc, rem = dense_layout(10), dense_layout(10, base=0)
    merged = descriptors(loc, rem, [0, 1, 2, 3], [4, 5, 6, 7])
    flat = descriptors(loc, rem, [0, 1, 2, 3], [4, 5, 6, 7], merge=False)
    assert len(merged[0]) == 2 and len(flat[0]) == 8
    assert int(merged[0][:, 1].sum()) == int(flat[0][:, 1].sum()) == 8 * 64


def test_empty_block_lists_give_empty_nx3_arrays():
    ld, rd = descriptors(dense_layout(4), dense_layout(4), [], [])
    assert ld.shape == rd.shape == (0, 3)


# -- descriptors: non-dense --------------------------------------------------------------------
def test_non_dense_planes_never_merge_and_address_each_block():
    loc, rem = interleaved_layout(6, base=0), interleaved_layout(6, base=1000)
    ld, rd = descriptors(loc, rem, [1, 2], [3, 4])
    assert ld.tolist() == [[128, 64, 0], [256, 64, 0], [128 + 64, 64, 0], [256 + 64, 64, 0]]
    assert rd.tolist() == [[1000 + 384, 64, 0], [1000 + 512, 64, 0],
                           [1000 + 448, 64, 0], [1000 + 576, 64, 0]]


def test_one_side_non_dense_disables_merging_for_that_plane():
    loc = dense_layout(6, base=0)
    rem = interleaved_layout(6, base=0)
    ld, rd = descriptors(loc, rem, [0, 1, 2], [0, 1, 2])
    assert len(ld) == len(rd) == 6
    assert rd[:3, 0].tolist() == [0, 128, 256]


@given(st.lists(st.tuples(st.integers(0, 15), st.integers(0, 15)), max_size=20),
       st.sampled_from(["dense", "interleaved"]))
def test_descriptors_cover_exactly_the_requested_block_bytes(ps, kind):
    mk = dense_layout if kind == "dense" else interleaved_layout
    loc, rem = mk(16, base=0), mk(16, base=1 << 20)
    li, ri = [a for a, _ in ps], [b for _, b in ps]
    ld, rd = descriptors(loc, rem, li, ri)
    assert len(ld) <= 2 * len(ps)

    # Runs may be emitted low-first (descending pairs merge too), so compare the set of
    # (local byte, remote byte) pairings, which is what decides correctness.
    pairs = list(zip(ld.tolist(), rd.tolist(), strict=True))
    assert all(n == m for (_, n, _), (_, m, _) in pairs)
    got = sorted((int(a) + k, int(b) + k) for (a, n, _), (b, _, _) in pairs for k in range(0, int(n), 64))
    planes = list(zip(loc.planes, rem.planes, strict=True))
    want = sorted((lp.block_addr(a) + k, rp.block_addr(b) + k) for lp, rp in planes
                  for a, b in zip(li, ri, strict=True) for k in range(0, lp.block_bytes, 64))
    assert got == want


@given(st.lists(st.tuples(st.integers(0, 15), st.integers(0, 15)), max_size=20),
       st.sampled_from(["dense", "interleaved"]), st.sets(st.integers(0, 1), min_size=1),
       st.booleans())
def test_layer_batches_cover_their_planes_bytes_call_after_call(ps, kind, planes, merge):
    """What a layer-wise WRITE asks once per batch of layers: the same ids (a tuple, whose
    runs are kept between calls) with a few planes; every call covers those planes' bytes
    of every pair, merged or one descriptor per block."""
    mk = dense_layout if kind == "dense" else interleaved_layout
    loc, rem = mk(16, base=0), mk(16, base=1 << 20)
    li, ri = tuple(a for a, _ in ps), tuple(b for _, b in ps)
    sel = sorted(planes)
    want = sorted((loc.planes[p].block_addr(a) + k, rem.planes[p].block_addr(b) + k)
                  for p in sel for a, b in zip(li, ri, strict=True)
                  for k in range(0, loc.planes[p].block_bytes, 64))
    for _ in range(2):
        ld, rd = descriptors(loc, rem, li, ri, merge=merge, planes=sel)
        assert len(ld) == len(rd) <= len(sel) * len(ps)
        got = sorted((int(a) + k, int(b) + k) for (a, n, _), (b, m, _) in
                     zip(ld.tolist(), rd.tolist(), strict=True) for k in range(0, int(n), 64))
        assert got == want and (merge or len(ld) == len(sel) * len(ps))


# -- descriptors against real tensors ----------------------------------------------------------
def test_descriptors_copy_the_right_bytes_between_cpu_tensors():
    n = 8
    src = {f"l{i}": torch.randn(2, n, 4, 8) for i in range(2)}
    dst = {f"l{i}": torch.zeros(2, n, 4, 8) for i in range(2)}
    src_lay, dst_lay = CpuBackend().describe(src, n, 4), CpuBackend().describe(dst, n, 4)
    local_ids, remote_ids = [0, 1, 2, 6], [5, 6, 7, 1]
    ld, rd = descriptors(dst_lay, src_lay, local_ids, remote_ids)
    import ctypes
    for (la, ln, _), (ra, rn, _) in zip(ld.tolist(), rd.tolist(), strict=True):
        assert ln == rn
        ctypes.memmove(int(la), int(ra), int(ln))
    for name in src:
        assert torch.equal(dst[name][:, local_ids], src[name][:, remote_ids])
        untouched = [b for b in range(n) if b not in local_ids]
        assert not dst[name][:, untouched].any()


# -- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize("li,ri,side", [([8], [0], "local"), ([0], [8], "remote"),
                                        ([-1], [0], "local"), ([0], [-1], "remote")])
def test_out_of_range_ids_raise_index_error(li, ri, side):
    with pytest.raises(IndexError, match=side):
        descriptors(dense_layout(8), dense_layout(8), li, ri)


def test_different_remote_block_count_is_fine_ids_checked_per_side():
    ld, rd = descriptors(dense_layout(4), dense_layout(100), [3], [99])
    assert len(ld) == 2 and int(rd[0][0]) == 10_000 + 99 * 64


@pytest.mark.parametrize("remote", [
    dense_layout(8, block_size=32),
    dense_layout(8, bb=128),
    dense_layout(8, planes=3),
    dense_layout(8, planes=1),
])
def test_mismatched_layouts_raise_layout_mismatch(remote):
    with pytest.raises(LayoutMismatch):
        check_compatible(dense_layout(8), remote)
    with pytest.raises(LayoutMismatch):
        descriptors(dense_layout(8), remote, [0], [0])


def test_layout_mismatch_is_a_value_error():
    assert issubclass(LayoutMismatch, ValueError)


def test_compatible_layouts_may_differ_in_addresses_devices_and_block_count():
    """Accepted, and a transfer between them addresses each side in its own terms: its
    base, its block count (plane stride) and its device."""
    local, remote = dense_layout(8, base=0, dev=0), dense_layout(64, base=1 << 40, dev=7)
    assert check_compatible(local, remote) is None
    ld, rd = descriptors(local, remote, [5, 6], [60, 61])  # one run of 2 blocks per plane
    assert ld.tolist() == [[5 * 64, 128, 0], [8 * 64 + 5 * 64, 128, 0]]
    assert rd.tolist() == [[(1 << 40) + 60 * 64, 128, 7], [(1 << 40) + 64 * 64 + 60 * 64, 128, 7]]


def test_peers_with_different_inner_order_are_incompatible():
    n = 4
    nhd = CpuBackend().describe({"l": torch.zeros(2, n, 16, 2, 8)}, n, 16)           # bs, heads, dim
    hnd = CpuBackend().describe({"l": torch.zeros(2, n, 2, 16, 8).transpose(2, 3)}, n, 16)
    with pytest.raises(LayoutMismatch):
        check_compatible(nhd, hnd)


# -- head segments between peers of different TP sizes ----------------------------------


def _rank_caches(g, tp, layout):
    """One global KV (N, H, BS, 2*HD) -> each rank's cache for its heads, and heads dim."""
    import torch

    from kvferry.connectors.protocol.tp_map import heads_of

    h = g.shape[1]
    out = []
    for r in range(tp):
        part = g[:, list(heads_of(r, tp, h))]
        if layout == "hnd":  # (N, heads, BS, 2*HD): vLLM's CPU attention
            out.append(part.contiguous())
        else:  # (2, N, BS, heads, HD): K/V planes, tokens outside heads
            out.append(torch.stack(part.permute(0, 2, 1, 3).chunk(2, dim=3)).contiguous())
    return out, (1 if layout == "hnd" else 3)


def _move(loc, rem):
    """Do a READ of the descriptors by hand: remote bytes -> local addresses."""
    import ctypes

    assert loc.shape == rem.shape and (loc[:, 1] == rem[:, 1]).all()
    for (la, n, _), (ra, _, _) in zip(loc.tolist(), rem.tolist(), strict=True):
        ctypes.memmove(la, ra, n)


@pytest.mark.parametrize("layout", ["hnd", "nhd"])
@pytest.mark.parametrize("h,p_tp,d_tp", [(4, 2, 1), (4, 1, 2), (2, 4, 1), (8, 2, 4), (4, 4, 4)])
def test_head_descriptors_rebuild_every_d_rank_from_p_ranks(layout, h, p_tp, d_tp):
    import torch

    from kvferry.connectors.memory.backends import CpuBackend
    from kvferry.connectors.protocol.tp_map import plan
    from kvferry.connectors.transfer.layout import head_descriptors

    n, bs = 10, 4
    g = torch.randn(n, h, bs, 16, generator=torch.Generator().manual_seed(h * 10 + p_tp))
    p_kv, hd = _rank_caches(g, p_tp, layout)
    d_kv, _ = _rank_caches(torch.zeros_like(g), d_tp, layout)
    p_lay = [CpuBackend().describe({"l": t}, n, bs, hd) for t in p_kv]
    d_lay = [CpuBackend().describe({"l": t}, n, bs, hd) for t in d_kv]
    src, dst = [1, 2, 3, 7, 6], [0, 1, 2, 4, 3]  # a run, then a descending pair
    for d in range(d_tp):
        for seg in plan(h, p_tp, d_tp, d):
            loc, rem = head_descriptors(d_lay[d], p_lay[seg.p_rank], dst, src, seg, False)
            _move(loc, rem)
    want = torch.zeros_like(g)
    want[dst] = g[src]
    w_kv, _ = _rank_caches(want, d_tp, layout)
    for d in range(d_tp):
        assert torch.equal(d_kv[d], w_kv[d]), f"D rank {d}"


def test_head_descriptors_merge_runs_when_heads_are_outermost():
    import torch

    from kvferry.connectors.memory.backends import CpuBackend
    from kvferry.connectors.protocol.tp_map import plan
    from kvferry.connectors.transfer.layout import head_descriptors

    n, bs = 8, 4
    (p0,), hd = _rank_caches(torch.zeros(n, 4, bs, 16), 1, "hnd")
    d_kv, _ = _rank_caches(torch.zeros(n, 4, bs, 16), 2, "hnd")
    p_lay = CpuBackend().describe({"l": p0}, n, bs, hd)
    d_lay = CpuBackend().describe({"l": d_kv[1]}, n, bs, hd)
    (seg,) = plan(4, 1, 2, 1)
    loc, _ = head_descriptors(d_lay, p_lay, [0, 1, 2], [3, 4, 5], seg, False)
    assert len(loc) == 3  # D's half-blocks are whole blocks there: P's rows are not adjacent
    loc, rem = head_descriptors(p_lay, d_lay, [3, 4, 5], [0, 1, 2], seg, True)
    assert len(loc) == 3 and int(rem[:, 1].sum()) == 3 * d_lay.planes[0].block_bytes


def test_heads_must_be_located_for_a_split_copy():
    import torch

    from kvferry.connectors.memory.backends import CpuBackend
    from kvferry.connectors.protocol.tp_map import Segment
    from kvferry.connectors.transfer.layout import LayoutMismatch, head_descriptors

    a = CpuBackend().describe({"l": torch.zeros(4, 2, 4, 16)}, 4, 4)  # heads dim not given
    b = CpuBackend().describe({"l": torch.zeros(4, 1, 4, 16)}, 4, 4, 1)
    with pytest.raises(LayoutMismatch, match="not located"):
        head_descriptors(a, b, [0], [0], Segment(0, 0, 0, 1), False)
    c = CpuBackend().describe({"l": torch.zeros(4, 1, 8, 16)}, 4, 8, 1)  # other block size
    with pytest.raises(LayoutMismatch, match="outside the heads"):
        head_descriptors(c, b, [0], [0], Segment(0, 0, 0, 1), False)
