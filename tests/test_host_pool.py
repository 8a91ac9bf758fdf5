"""The host tier's memory over real NIXL (UCX, DRAM): D copies leased blocks into pool
slots and back with transfers of its own agent, and P READs slots of D's pool as it READs
HBM blocks (issue 34; the pool is not wired into the connector yet).

Two kinds of cache plane: dense (2, N, ...) and a strided view (every other block of a
bigger buffer), so both the merged and the block-by-block descriptor paths run.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest
import torch

from kvferry.connectors.memory.backends import CpuBackend, KVLayout
from kvferry.connectors.memory.host_pool import HostPool, pool_layout, slot_bytes
from kvferry.connectors.transfer.layout import LayoutMismatch
from kvferry.connectors.transfer.transport import Transfer, TransferError, Transport

pytestmark = pytest.mark.timeout(60)

N, BS, SLOTS = 12, 4, 6


def make_caches(seed: int | None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed or 0)

    def t(*shape: int) -> torch.Tensor:
        return torch.zeros(shape) if seed is None else torch.randn(*shape, generator=g)

    return {"dense": t(2, N, BS, 2, 8), "strided": t(2 * N, 2, BS, 8)[::2]}


def blocks(c: dict[str, torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    return [c["dense"][:, ids].clone(), c["strided"][ids].clone()]


def raw(addr: int, n: int) -> bytes:
    return bytes(np.frombuffer((ctypes.c_uint8 * n).from_address(addr), dtype=np.uint8))


def wait(tr: Transport, x: Transfer, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while (state := tr.poll(x)) == "PROC" and time.monotonic() < deadline:
        time.sleep(0.002)
    return state


@pytest.fixture
def d():
    caches = make_caches(7)
    tr = Transport(CpuBackend().describe(caches, N, BS), name="kvferry-pool-D")
    pool = HostPool(tr.layout, SLOTS)
    yield tr, caches, pool, tr.add_pool(pool.layout)
    tr.close()


def test_the_pool_is_laid_out_like_the_cache_one_slot_per_block() -> None:
    lay = CpuBackend().describe(make_caches(None), N, BS)
    pool = HostPool(lay, SLOTS)
    assert pool.nbytes == SLOTS * slot_bytes(lay) == SLOTS * sum(p.block_bytes for p in lay.planes)
    assert pool.layout.signature() == lay.signature() and pool.layout.num_blocks == SLOTS
    assert pool.layout.regions[0].length == pool.nbytes
    assert KVLayout.from_wire(pool.layout.to_wire()) == pool.layout  # P learns it as D's layout
    with pytest.raises(ValueError, match="at least one slot"):
        pool_layout(lay, 0, pool.buffer.data_ptr())


def test_a_spill_copies_each_block_into_its_slot_and_a_restore_brings_it_back(d) -> None:
    tr, caches, pool, me = d
    want = blocks(caches, [5, 2, 7])
    assert wait(tr, tr.start("WRITE", me, [5, 2, 7], [0, 1, 2])) == "DONE"
    for kp, pp in zip(tr.layout.planes, pool.layout.planes, strict=True):
        for b, s in ((5, 0), (2, 1), (7, 2)):
            assert raw(pp.block_addr(s), pp.block_bytes) == raw(kp.block_addr(b), kp.block_bytes)
    for pp in pool.layout.planes:  # slots nobody wrote stay as they were
        assert all(not any(raw(pp.block_addr(s), pp.block_bytes)) for s in range(3, SLOTS))
    for t in caches.values():  # HBM blocks given up: the KV now lives only in the pool
        t.zero_()
    assert wait(tr, tr.start("READ", me, [9, 10, 11], [0, 1, 2])) == "DONE"
    for got, exp in zip(blocks(caches, [9, 10, 11]), want, strict=True):
        assert torch.equal(got, exp)


def test_p_reads_slots_of_d_pool_as_it_reads_blocks(d) -> None:
    tr, caches, pool, me = d
    want = blocks(caches, [7, 5])
    assert wait(tr, tr.start("WRITE", me, [5, 7], [0, 2])) == "DONE"
    p_caches = make_caches(None)
    p = Transport(CpuBackend().describe(p_caches, N, BS), name="kvferry-pool-P")
    try:
        d_peer = p.add_peer("D", tr.metadata(), tr.layout)
        d_pool = p.pool_of(d_peer, KVLayout.from_wire(pool.layout.to_wire()))
        assert d_pool.agent_name == d_peer.agent_name
        assert wait(p, p.start("READ", d_pool, [1, 3], [2, 0], notif=b"kvferry/pool")) == "DONE"
        for got, exp in zip(blocks(p_caches, [1, 3]), want, strict=True):
            assert torch.equal(got, exp)
        deadline = time.monotonic() + 10  # D hears of it as of any READ of its blocks
        notes: list[bytes] = []
        while b"kvferry/pool" not in notes and time.monotonic() < deadline:
            notes += tr.notifications()
        assert b"kvferry/pool" in notes
    finally:
        p.close()


def test_slots_outside_the_pool_are_refused_before_anything_is_posted(d) -> None:
    tr, _, _, me = d
    for slot in (SLOTS, -1):
        with pytest.raises(IndexError, match="remote block id"):
            tr.start("WRITE", me, [0], [slot])


def test_a_pool_shaped_for_another_cache_is_refused(d) -> None:
    tr, _, pool, me = d
    other = CpuBackend().describe({"x": torch.zeros(2, N, BS, 4, 8)}, N, BS)
    wrong = HostPool(other, SLOTS)
    with pytest.raises(LayoutMismatch):
        Transport.pool_of(me, wrong.layout)
    with pytest.raises(TransferError, match="host pool already"):
        tr.add_pool(pool.layout)
    fresh = Transport(other, name="kvferry-pool-other")
    try:
        with pytest.raises(LayoutMismatch):
            fresh.add_pool(pool.layout)
    finally:
        fresh.close()
