"""Neuron path against a FAKE libnrt (tests/fakes/fake_libnrt.c) and CPU stand-in tensors.

The fake is as strict as the real runtime where it matters: device VAs are not host
memory unless HBM is mapped (NEURON_RT_MAP_HBM=1 at runtime start), a non-HBM address has
no EFA rail (NRT_FAILURE), and a second nrt_init is refused. The "framework" (the test)
starts the runtime; kvferry must never do so.
"""

from __future__ import annotations

import ctypes
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fakes.nrt_runtime import FakeRuntime, build, host_readable

from kvferry.connectors.config import ConnectorConfig
from kvferry.connectors.memory.backends import DRAM, VRAM
from kvferry.connectors.memory.registry import get_backend
from kvferry.neuron import envcheck, envcheck_libfabric, libnrt
from kvferry.neuron.arrays import NeuronArray
from kvferry.neuron.backend import ENV_MAP_HBM, ENV_STAGING, NeuronBackend, RegistrationError
from kvferry.neuron.findings import MISSING, OK, WARN, Finding
from kvferry.neuron.libnrt import NrtTensor

NB, BS, HEADS, DIM, ES = 8, 4, 2, 16, 2  # num_blocks, block_size, kv heads, head dim, bf16
BLOCK_BYTES = BS * HEADS * DIM * ES


@pytest.fixture(scope="session")
def fake_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("fake_nrt") / "libnrt.so.1")


@pytest.fixture
def runtime(fake_lib: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., FakeRuntime]]:
    """Start the fake runtime the way the framework would (``runtime(map_hbm=...)``) and
    point kvferry's libnrt at it; every test starts from a fresh runtime."""
    monkeypatch.setenv(libnrt.ENV_LIBNRT, str(fake_lib))
    monkeypatch.delenv(ENV_STAGING, raising=False)
    monkeypatch.setenv(ENV_MAP_HBM, "0")  # start() sets it as the worker does; undone after
    rt = FakeRuntime(fake_lib)

    def start(map_hbm: bool = False) -> FakeRuntime:
        rt.reset()
        libnrt.reset()
        rt.start(map_hbm=map_hbm)
        return rt

    yield start
    rt.reset()
    libnrt.reset()


@pytest.fixture
def nrt(runtime) -> libnrt.Libnrt:
    """kvferry's binding of a runtime the framework started (HBM not mapped)."""
    runtime()
    return libnrt.load()


@pytest.fixture
def private(fake_lib: Path, tmp_path: Path) -> tuple[FakeRuntime, libnrt.Libnrt]:
    """A private copy of the fake (own global state), not started, for lifecycle tests."""
    path = tmp_path / "libnrt_private.so.1"
    shutil.copy(fake_lib, path)
    return FakeRuntime(path), libnrt.Libnrt(str(path))


def kv_pair(lib: libnrt.Libnrt, vnc: int) -> tuple[NrtTensor, NrtTensor]:
    shape = (NB, BS, HEADS, DIM)
    return (NrtTensor.allocate(shape, ES, vnc, "k", lib), NrtTensor.allocate(shape, ES, vnc, "v", lib))


def fill(t: NrtTensor, seed: int) -> bytes:
    data = bytes((seed * 31 + i * 7) % 251 for i in range(t.nbytes))
    buf = ctypes.create_string_buffer(data, len(data))
    t.lib.tensor_write(t.handle, ctypes.addressof(buf), 0, len(data))
    return data


def read(t: NrtTensor) -> bytes:
    buf = ctypes.create_string_buffer(t.nbytes)
    t.lib.tensor_read(t.handle, ctypes.addressof(buf), 0, t.nbytes)
    return buf.raw


def hnd(num_blocks: int = NB, seed: int = 0) -> torch.Tensor:
    """A vllm-neuron per-layer KV tensor's shape and dtype, (2, N, H, 32, D) bf16 (a CPU
    stand-in: no Neuron device here)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, HEADS, 32, DIM, generator=g).to(torch.bfloat16)


# -- the fake runtime is as strict as the real one ----------------------------------------
def test_missing_library_is_precise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(libnrt.ENV_LIBNRT, "/nonexistent/libnrt.so.1")
    libnrt.reset()
    with pytest.raises(libnrt.LibnrtNotFound, match=r"/nonexistent/libnrt.so.1.*KVFERRY_LIBNRT"):
        libnrt.load()
    libnrt.reset()


def test_lifecycle_and_queries_allowed_before_init(private, monkeypatch: pytest.MonkeyPatch) -> None:
    rt, lib = private
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "8-11,20")
    monkeypatch.setenv(ENV_MAP_HBM, "0")
    assert lib.total_nc_count() == 64 and lib.visible_nc_count() == 5  # nrt.h: before init
    with pytest.raises(libnrt.NrtStateError, match="NRT_UNINITIALIZED"):
        lib.tensor_allocate(64)
    rt.start()  # the framework starts the runtime
    h = lib.tensor_allocate(64, vnc=3)
    assert lib.tensor_get_size(h) == 64
    lib.tensor_free(h)
    rt.lib.nrt_close()
    with pytest.raises(libnrt.NrtStateError, match="NRT_CLOSED") as e:
        lib.tensor_allocate(64)
    assert e.value.status == 14 and e.value.func == "nrt_tensor_allocate"
    assert not hasattr(lib, "init") and not hasattr(lib, "close")  # kvferry cannot start it


def test_a_second_nrt_init_is_refused(runtime) -> None:
    rt = runtime()
    with pytest.raises(RuntimeError, match="returned 1"):  # NRT_FAILURE
        rt.start()
    assert rt.init_calls == 2


def test_status_codes_map_to_exceptions(nrt: libnrt.Libnrt, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(libnrt.NrtInvalidError, match="NRT_INVALID"):
        nrt.tensor_allocate(0)
    monkeypatch.setenv("FAKE_NRT_MAX_BYTES", "1024")
    with pytest.raises(MemoryError, match="NRT_RESOURCE"):
        nrt.tensor_allocate(4096)
    with pytest.raises(libnrt.NrtHardwareError, match="NRT_HW_ERROR"):
        libnrt.check("nrt_execute", 6)
    with pytest.raises(libnrt.NrtError, match=r"unknown NRT_STATUS \(777\)"):
        libnrt.check("nrt_execute", 777)
    h = nrt.tensor_allocate(16)
    buf = ctypes.create_string_buffer(32)
    with pytest.raises(libnrt.NrtInvalidError, match="nrt_tensor_read"):
        nrt.tensor_read(h, ctypes.addressof(buf), 8, 16)  # past the end
    nrt.tensor_free(h)


def test_device_vas_are_not_host_memory(nrt: libnrt.Libnrt) -> None:
    t = NrtTensor.allocate((4, 8), 1, vnc=2, lib=nrt)
    data = fill(t, 3)
    assert not host_readable(t.va, t.nbytes)  # dereferencing it would fault, as on trn2
    assert read(t) == data  # the runtime's copy reaches the bytes
    assert nrt.get_attached_efa_bdf(t.va + 5) == "0000:10:1c.0"
    host = ctypes.create_string_buffer(64)
    with pytest.raises(libnrt.NrtError, match="NRT_FAILURE") as e:  # nrt.h: not Neuron memory
        nrt.get_attached_efa_bdf(ctypes.addressof(host))
    assert e.value.code == libnrt.NrtStatus.FAILURE
    t.free()
    assert t.handle == 0


def test_mapped_hbm_vas_are_host_memory(runtime) -> None:
    rt = runtime(map_hbm=True)
    lib = libnrt.load()
    t = NrtTensor.allocate((4, 8), 1, vnc=2, lib=lib)
    data = fill(t, 5)
    assert rt.hbm_mapped and host_readable(t.va, t.nbytes)
    assert ctypes.string_at(t.va, t.nbytes) == data
    t.free()


# -- point 3: kvferry never starts the runtime -------------------------------------------
def test_kvferry_never_starts_the_runtime(runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """envcheck, describe and the connector's register path run in a worker whose
    runtime the framework started: no nrt_init of their own."""
    from fakes.vllm_neuron import FakeNeuronWorker
    from helpers_http import free_port

    from kvferry.connectors.protocol.params import SECRET_ENV

    rt = runtime()
    lib = libnrt.load()
    envcheck.run_checks(colocated=True, env={"FI_EFA_USE_DEVICE_RDMA": "1"})
    assert rt.init_calls == 1
    b = NeuronBackend(staging="device")
    b.describe({"l": kv_pair(lib, 4)}, NB, BS)
    assert rt.init_calls == 1

    monkeypatch.setenv(SECRET_ENV, "never-init")
    w = FakeNeuronWorker("P-nrt", {"hardware_backend": "neuron", "neuron_staging": "host",
                                   "nixl_backends": ["UCX"], "side_channel_port": free_port()},
                         monkeypatch, num_blocks=NB)
    try:
        w.register({"layer.0": kv_pair(lib, 0), "layer.1": kv_pair(lib, 1)})
        assert w.backend.mode == "host" and w.backend.attempts[-1].outcome == "registered"
    finally:
        w.close()
    assert rt.init_calls == 1  # the framework's, nobody else's


# -- describe -------------------------------------------------------------------------------
def test_get_backend_neuron_is_lazy_import() -> None:
    b = get_backend("neuron")
    assert isinstance(b, NeuronBackend)
    assert (b.name, b.mem_type, b.default_nixl_backends) == ("neuron", VRAM, ("LIBFABRIC",))
    assert b.may_stage and b.copy is None  # auto may end host-staged; default copies


def test_describe_kv_pairs(nrt: libnrt.Libnrt) -> None:
    caches = {"layer.0": kv_pair(nrt, 0), "layer.1": kv_pair(nrt, 5)}
    b = NeuronBackend(staging="device")
    layout = b.describe(caches, NB, BS)
    assert b.mode == "device" and b.nixl_backends == ("LIBFABRIC",)
    tensors = [t for kv in caches.values() for t in kv]
    assert [r.addr for r in layout.regions] == [t.va for t in tensors]
    assert all(r.length == NB * BLOCK_BYTES and r.mem_type == VRAM for r in layout.regions)
    assert [r.device_id for r in layout.regions] == [0, 0, 5, 5]
    assert [p.region for p in layout.planes] == [0, 1, 2, 3]  # L0.K, L0.V, L1.K, L1.V
    for p, t in zip(layout.planes, tensors, strict=True):
        assert (p.base, p.stride, p.block_bytes, p.num_blocks) == (t.va, BLOCK_BYTES, BLOCK_BYTES, NB)
        assert p.block_addr(3) == t.va + 3 * BLOCK_BYTES
    assert layout.signature()[0] == BS
    assert [nbytes for nbytes, _fmt in layout.signature()[1]] == [BLOCK_BYTES] * 4


def test_torch_tensors_describe_like_vllm_neuron_hands_them() -> None:
    """Point 2: one HND tensor per layer, as vllm-neuron's runner registers them; the
    addresses are data_ptr() (what upstream's NixlConnector registers)."""
    caches = {"l0": hnd(seed=1), "l1": hnd(seed=2)}
    b = NeuronBackend(staging="device")
    heads_dim = b.kv_heads_dim(caches)
    layout = b.describe(caches, NB, 32, heads_dim)
    block = HEADS * 32 * DIM * ES
    assert heads_dim == 2 and layout.num_heads == HEADS
    assert [r.addr for r in layout.regions] == [t.data_ptr() for t in caches.values()]
    assert all(r.mem_type == VRAM and r.length == 2 * NB * block for r in layout.regions)
    assert [(p.base, p.stride, p.block_bytes) for p in layout.planes] == [
        (t[kv].data_ptr(), block, block) for t in caches.values() for kv in (0, 1)]
    p = layout.planes[3]  # l1's V plane, block 5: exactly the tensor's bytes
    want = caches["l1"][1, 5].contiguous().view(torch.uint8).numpy().tobytes()
    assert ctypes.string_at(p.block_addr(5), p.block_bytes) == want


def test_raw_handle_is_size_only(nrt: libnrt.Libnrt) -> None:
    h = nrt.tensor_allocate(NB * 256, vnc=1)
    b = NeuronBackend(staging="device", default_vnc=1)
    layout = b.describe({"l0": (ctypes.c_void_p(h), ctypes.c_void_p(h))}, NB, BS)
    assert len(layout.regions) == 1 and layout.regions[0].device_id == 1  # same memory twice
    assert [(p.stride, p.block_bytes) for p in layout.planes] == [(256, 256), (256, 256)]
    nrt.tensor_free(h)


@dataclass
class View:
    """A NeuronArray from some other framework: plain attributes, strides optional."""

    va: int
    shape: tuple[int, ...]
    itemsize: int
    vnc: int
    nbytes: int
    strides: tuple[int, ...] | None = None


def test_protocol_objects_and_shared_allocation(nrt: libnrt.Libnrt) -> None:
    nbytes = 2 * NB * BLOCK_BYTES
    t = NrtTensor.allocate((nbytes,), 1, vnc=4, lib=nrt)
    half = NB * BLOCK_BYTES
    combined = View(t.va, (2, NB, BS, HEADS, DIM), ES, 4, nbytes)
    k = View(t.va, (NB, BS, HEADS, DIM), ES, 4, half)
    v = View(t.va + half, (NB, BS, HEADS, DIM), ES, 4, half)
    assert isinstance(k, NeuronArray)
    b = NeuronBackend(staging="device")
    lay = b.describe({"a": combined, "b": (k, v)}, NB, BS)
    assert len(lay.regions) == 1 and lay.regions[0].length == nbytes
    assert [p.base for p in lay.planes] == [t.va, t.va + half, t.va, t.va + half]
    # (num_blocks, kv_heads, block_size, head_dim) with a padded block stride
    padded = View(t.va, (NB // 2, HEADS, BS, DIM), ES, 4, nbytes,
                  strides=(2 * BLOCK_BYTES, BS * DIM * ES, DIM * ES, ES))
    lay = NeuronBackend(staging="device").describe({"p": padded}, NB // 2, BS)
    assert (lay.planes[0].stride, lay.planes[0].block_bytes) == (2 * BLOCK_BYTES, BLOCK_BYTES)
    t.free()


def test_describe_errors(nrt: libnrt.Libnrt) -> None:
    b = NeuronBackend(staging="device")
    with pytest.raises(TypeError, match="not a Neuron KV array"):
        b.describe({"l": object()}, NB, BS)
    with pytest.raises(TypeError, match="torch tensor on meta"):
        b.describe({"l": torch.empty(2, NB, 4, device="meta")}, NB, BS)
    k, v = kv_pair(nrt, 0)
    with pytest.raises(ValueError, match="num_blocks=7"):
        b.describe({"l": (k, v)}, 7, BS)
    with pytest.raises(ValueError, match=r"\(K, V\) pair"):
        b.describe({"l": (k, v, k)}, NB, BS)
    with pytest.raises(ValueError, match="allocation"):
        b.describe({"l": View(k.va, (NB * 2, BS, HEADS, DIM), ES, 0, k.nbytes)}, NB * 2, BS)
    with pytest.raises(ValueError, match="ambiguous"):
        b.describe({"l": torch.zeros(2, 2, 4)}, 2, BS)
    with pytest.raises(ValueError, match="neuron_staging"):
        NeuronBackend(staging="gpu")
    with pytest.raises(ValueError, match="neuron_staging"):
        NeuronBackend().configure({"neuron_staging": "sometimes"})


def test_configure_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_STAGING, "host")
    assert NeuronBackend().staging_mode == "host"
    b = NeuronBackend().configure({"neuron_staging": "mapped", "nixl_backends": ["UCX"]})
    assert (b.staging_mode, b.forced_backends, b.may_stage) == ("mapped", ("UCX",), False)
    assert ConnectorConfig.from_extra({"neuron_staging": "mapped"}).neuron_staging == "mapped"


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


# -- envcheck ------------------------------------------------------------------------------
def test_envcheck_findings(nrt: libnrt.Libnrt, tmp_path: Path) -> None:
    f = envcheck.check_libnrt()
    assert f.status == OK and "64 NeuronCores" in f.detail  # asked before/without init
    f = envcheck.check_libfabric("/nonexistent/libfabric.so.1")
    assert f.blocking and "unusable" in f.detail and "EFA installer" in f.fix
    bad = envcheck.check_shm(True, {})
    assert bad.blocking and "FI_EFA_ENABLE_SHM_TRANSFER=0" in bad.fix
    assert envcheck.check_shm(True, {"FI_EFA_ENABLE_SHM_TRANSFER": "0"}).status == OK
    assert envcheck.check_shm(False, {}).status == OK
    assert "FI_EFA_USE_DEVICE_RDMA=1" in envcheck.check_hmem({}).fix
    assert envcheck.check_map_hbm({"NEURON_RT_MAP_HBM": "1"}).status == OK
    assert envcheck.check_map_hbm({}).status == WARN
    sysfs = tmp_path / "ib"
    (sysfs / "rdmap16s27" / "device").mkdir(parents=True)
    (tmp_path / "drivers" / "efa").mkdir(parents=True)
    os.symlink(tmp_path / "drivers" / "efa", sysfs / "rdmap16s27" / "device" / "driver")
    ok = envcheck.check_efa_devices(str(sysfs))
    assert ok.status == OK and "rdmap16s27" in ok.detail
    (tmp_path / "empty").mkdir()
    if not shutil.which("fi_info"):
        assert envcheck.check_efa_devices(str(tmp_path / "empty")).blocking


def test_envcheck_main_exit_code(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(envcheck, "run_checks", lambda *a, **k: [
        Finding("libfabric", MISSING, "1.17 < 1.21", "install EFA", True)])
    assert envcheck.main([]) == 1
    assert "[FAIL] libfabric" in capsys.readouterr().out
    monkeypatch.setattr(envcheck, "run_checks", lambda *a, **k: [
        Finding("libnrt", OK, "loaded")])
    assert envcheck.main(["--json"]) == 0


def test_real_host_report_runs(nrt: libnrt.Libnrt) -> None:
    """The full report on this machine: every check answers, nothing raises."""
    findings = envcheck.run_checks(colocated=True, env={"FI_EFA_USE_DEVICE_RDMA": "1"})
    names = [f.check for f in findings]
    assert names[0] == "libnrt" and "libfabric" in names and "efa-shm" in names
    assert "map-hbm" in names and "init-order" not in names
    assert all(f.status in (OK, MISSING, WARN) for f in findings)


def test_unresolved_names_missing_libraries_and_symbol_versions() -> None:
    """Measured here: NIXL 1.5.1's plugin with libfabric 2.1.0 (Debian's newest, built from
    source) loads the library but lacks the FABRIC_1.10 fi_getinfo ABI; the check says so."""
    ldd = ("/x/libplugin_LIBFABRIC.so: /opt/lf/lib/libfabric.so.1: version `FABRIC_1.10' not "
           "found (required by /x/libplugin_LIBFABRIC.so)\n"
           "\tlinux-vdso.so.1 (0x00007ffd)\n"
           "\tlibfabric.so.1 => /opt/lf/lib/libfabric.so.1 (0x00007f)\n"
           "\tlibcuda.so.1 => not found\n")
    assert envcheck_libfabric.unresolved(ldd) == ["FABRIC_1.10 (not in libfabric.so.1)", "libcuda.so.1"]
    assert envcheck_libfabric.unresolved("\tlibc.so.6 => /lib/libc.so.6 (0x1)\n") == []


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
