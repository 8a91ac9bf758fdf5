"""Neuron path, registration modes (device, mapped, host, auto): each registers what it
says, auto falls back to host staging when NIXL refuses, host staging copies byte-exact,
and only the modes that may stage turn decode leases off.

Against a FAKE libnrt (tests/fakes/fake_libnrt.c) and CPU stand-in tensors; the fake is as
strict as the real runtime where it matters (tests/helpers_neuron.py)."""

from __future__ import annotations

import ctypes

import helpers_neuron
import pytest
import torch
from fakes.nrt_runtime import host_readable
from helpers_neuron import BLOCK_BYTES, BS, NB, View, fill, hnd, kv_pair, read

from kvferry.connectors.memory.backends import DRAM, VRAM
from kvferry.connectors.memory.registry import get_backend
from kvferry.neuron import libnrt
from kvferry.neuron.backend import ENV_MAP_HBM, NeuronBackend, RegistrationError

fake_lib = helpers_neuron.fake_lib
runtime = helpers_neuron.runtime
nrt = helpers_neuron.nrt
private = helpers_neuron.private


# -- point 6: the three registration modes, selectable ----------------------------------------
def test_each_mode_registers_what_it_says(runtime) -> None:
    rt = runtime(map_hbm=True)  # as vllm-neuron's worker starts it
    lib = libnrt.load()
    caches = {"l": kv_pair(lib, 0)}
    vas = [t.va for t in caches["l"]]
    lay = {m: NeuronBackend(staging=m).describe(caches, NB, BS) for m in ("device", "mapped")}
    assert [(r.addr, r.mem_type) for r in lay["device"].regions] == [(va, VRAM) for va in vas]
    assert [(r.addr, r.mem_type) for r in lay["mapped"].regions] == [(va, DRAM) for va in vas]
    assert lay["mapped"].planes == lay["device"].planes  # the same bytes, another mem type
    assert rt.hbm_mapped and all(host_readable(va, NB * BLOCK_BYTES) for va in vas)
    host = NeuronBackend(staging="host")
    mirror = host.describe(caches, NB, BS)
    assert host.mode == "host" and {r.mem_type for r in mirror.regions} == {DRAM}
    assert not {r.addr for r in mirror.regions} & set(vas)  # pinned mirrors, not the HBM
    assert mirror.signature() == lay["device"].signature()
    host.staging.close()


def test_mapped_needs_hbm_mapped(nrt: libnrt.Libnrt) -> None:
    """Unmapped HBM registered as DRAM would register addresses the host cannot touch."""
    with pytest.raises(RegistrationError, match="NEURON_RT_MAP_HBM is not 1") as e:
        NeuronBackend(staging="mapped").describe({"l": kv_pair(nrt, 0)}, NB, BS)
    assert [(a.mode, a.outcome) for a in e.value.attempts] == [("mapped", "skipped")]
    b = NeuronBackend(staging="mapped", env={ENV_MAP_HBM: "1"})
    assert b.describe({"t": hnd()}, NB, 32).regions[0].mem_type == DRAM


# -- point 5: registration falls back at engine start ------------------------------------------
def test_auto_falls_back_to_host_staging_when_nixl_refuses(nrt: libnrt.Libnrt) -> None:
    """auto on unmapped HBM: mapped is skipped (HBM not mapped), device registration is
    refused by NIXL (UCX here; LIBFABRIC without FI_HMEM_NEURON on a trn2), host staging
    registers; every step is recorded."""
    from kvferry.connectors.transfer.transport import Transport

    k, v = kv_pair(nrt, 0)
    dk, dv = fill(k, 1), fill(v, 2)
    b = NeuronBackend().configure({"nixl_backends": ["UCX"]})
    layout = b.describe({"l": (k, v)}, NB, BS)
    assert b.mode == "device" and layout.regions[0].mem_type == VRAM
    t = b.register_with(layout, lambda lay: Transport(lay, b.nixl_backends))
    try:
        assert [(a.mode, a.backends, a.outcome) for a in b.attempts] == [
            ("mapped", (), "skipped"), ("device", ("UCX",), "failed"),
            ("host", ("UCX",), "registered")]
        assert b.mode == "host" and t.layout is b.staging.layout and t.mem_type == DRAM
        b.staging.stage_out([1, 6])  # the mirror now holds the device's bytes
        for plane, data in zip(t.layout.planes, (dk, dv), strict=True):
            for blk in (1, 6):
                got = ctypes.string_at(plane.block_addr(blk), BLOCK_BYTES)
                assert got == data[blk * BLOCK_BYTES:(blk + 1) * BLOCK_BYTES]
    finally:
        t.close()
        b.staging.close()


def test_register_with_lets_other_errors_through(nrt: libnrt.Libnrt) -> None:
    b = NeuronBackend(staging="device")
    layout = b.describe({"l": kv_pair(nrt, 0)}, NB, BS)

    def bind_fails(lay):  # e.g. the side-channel port is taken: not a registration problem
        raise OSError("Address already in use")

    with pytest.raises(OSError, match="in use"):
        b.register_with(layout, bind_fails)
    assert b.attempts == [] and b.mode == "device"


# -- host staging ----------------------------------------------------------------------------
def test_host_staging_round_trip_is_byte_exact(nrt: libnrt.Libnrt) -> None:
    k, v = kv_pair(nrt, 1)
    dk, dv = fill(k, 1), fill(v, 2)
    b = NeuronBackend(staging="host")
    lay = b.describe({"l": (k, v)}, NB, BS)
    st = b.staging
    assert b.mode == "host" and all(r.mem_type == DRAM for r in lay.regions)
    nbytes, ms = st.stage_out([5, 1, 2])
    assert nbytes == 2 * 3 * BLOCK_BYTES and ms >= 0 and st.stats.last["bytes"] == nbytes
    for plane, data in zip(lay.planes, (dk, dv), strict=True):
        for blk in range(NB):
            got = ctypes.string_at(plane.block_addr(blk), BLOCK_BYTES)
            want = data[blk * BLOCK_BYTES:(blk + 1) * BLOCK_BYTES] if blk in (1, 2, 5) else \
                bytes(BLOCK_BYTES)
            assert got == want, blk
    # a peer wrote block 3 of our V mirror; stage_in puts exactly that into HBM
    new = bytes(range(256)) * (BLOCK_BYTES // 256) + bytes(BLOCK_BYTES % 256)
    ctypes.memmove(lay.planes[1].block_addr(3), new, BLOCK_BYTES)
    st.stage_in([3])
    after = read(v)
    assert after[3 * BLOCK_BYTES:4 * BLOCK_BYTES] == new
    assert after[:3 * BLOCK_BYTES] == dv[:3 * BLOCK_BYTES]
    assert after[4 * BLOCK_BYTES:] == dv[4 * BLOCK_BYTES:]
    # stage_in moves whole blocks of every plane: K's block 3 now holds its (zero) mirror
    assert read(k) == dk[:3 * BLOCK_BYTES] + bytes(BLOCK_BYTES) + dk[4 * BLOCK_BYTES:]
    assert st.stats.transfers == 2 and st.stats.bytes == nbytes + 2 * BLOCK_BYTES
    st.close()


def test_host_staging_copies_torch_tensors_by_default() -> None:
    """Point 5: get_backend("neuron") stages vllm-neuron's torch tensors with no injected
    copy function (Tensor.copy_ both ways)."""
    t = hnd(seed=3)
    before = t.clone()
    b = get_backend("neuron").configure({"neuron_staging": "host"})
    lay = b.describe({"l": t}, NB, 32, b.kv_heads_dim({"l": t}))
    st = b.staging
    try:
        st.stage_out([2, 7])
        for kv, plane in enumerate(lay.planes):
            for blk in range(NB):
                got = ctypes.string_at(plane.block_addr(blk), plane.block_bytes)
                want = t[kv, blk].contiguous().view(torch.uint8).numpy().tobytes()
                assert (got == want) is (blk in (2, 7)), (kv, blk)
        ctypes.memset(lay.planes[1].block_addr(4), 0x5A, lay.planes[1].block_bytes)
        st.stage_in([4])  # a peer wrote V block 4 of the mirror (K's mirror block 4 is zero)
        assert torch.equal(t[1, 4].view(torch.uint8), torch.full_like(t[1, 4].view(torch.uint8), 0x5A))
        assert not t[0, 4].any()
        others = [i for i in range(NB) if i != 4]
        assert torch.equal(t[:, others], before[:, others])
    finally:
        st.close()


def test_host_staging_injected_copy(nrt: libnrt.Libnrt) -> None:
    calls = []
    host = ctypes.create_string_buffer(NB * 64)
    arr = View(ctypes.addressof(host), (NB, 64), 1, 0, NB * 64)
    b = NeuronBackend(staging="host", copy=lambda *a: calls.append(a))
    b.describe({"x": arr}, NB, BS)
    b.staging.stage_out([0, 1, 2, 6])
    assert [(d, off, n) for d, _, off, _, n in calls] == [("d2h", 0, 192), ("d2h", 384, 64)]
    b.staging.close()


def test_host_mode_without_a_copy_path_is_refused() -> None:
    host = ctypes.create_string_buffer(NB * 64)
    with pytest.raises(RegistrationError, match="no copy path"):
        NeuronBackend(staging="host").describe(
            {"x": View(ctypes.addressof(host), (NB, 64), 1, 0, NB * 64)}, NB, BS)


@pytest.mark.parametrize(("mode", "stages"), [("auto", True), ("host", True),
                                              ("device", False), ("mapped", False)])
def test_only_modes_that_may_stage_turn_leases_off(mode: str, stages: bool) -> None:
    """The scheduler grants decode leases unless KV may be host-staged: device VRAM and
    mapped HBM are registered in place, so a leased block is what D decoded."""
    from types import SimpleNamespace

    from kvferry.connectors.connector import KvferryConnector

    fake_self = SimpleNamespace(
        cfg=SimpleNamespace(hardware_backend="neuron"),
        _kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"neuron_staging": mode}))
    assert KvferryConnector._host_staging_possible(fake_self) is stages
