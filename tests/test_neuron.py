"""Neuron path against a fake libnrt compiled from tests/fakes/fake_libnrt.c."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvferry.connectors.memory import DRAM, VRAM, get_backend
from kvferry.neuron import envcheck, libnrt
from kvferry.neuron.arrays import NeuronArray
from kvferry.neuron.backend import NeuronBackend
from kvferry.neuron.libnrt import NrtTensor

FAKE_SRC = Path(__file__).parent / "fakes" / "fake_libnrt.c"
NB, BS, HEADS, DIM, ES = 8, 4, 2, 16, 2  # num_blocks, block_size, kv heads, head dim, bf16
BLOCK_BYTES = BS * HEADS * DIM * ES


def build_fake(out: Path) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc not found: cannot build the fake libnrt (tests/fakes/fake_libnrt.c)")
    subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-o", str(out), str(FAKE_SRC)], check=True)
    return out


@pytest.fixture(scope="session")
def fake_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("fake_nrt")
    build_fake(d / "libnrt.so.1")
    return d


@pytest.fixture
def nrt(fake_dir: Path, monkeypatch: pytest.MonkeyPatch) -> libnrt.Libnrt:
    """The process-wide libnrt, pointed at the fake and initialised."""
    monkeypatch.setenv(libnrt.ENV_LIBNRT, str(fake_dir / "libnrt.so.1"))
    libnrt.reset()
    lib = libnrt.load()
    lib._initialized = False  # the fake keeps its own state; re-init is idempotent there
    lib.init()
    yield lib
    libnrt.reset()


@pytest.fixture
def fresh_nrt(fake_dir: Path, tmp_path: Path) -> libnrt.Libnrt:
    """A private copy of the fake (own global state) for lifecycle tests."""
    path = tmp_path / "libnrt_private.so.1"
    shutil.copy(fake_dir / "libnrt.so.1", path)
    return libnrt.Libnrt(str(path))


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


# -- libnrt binding ----------------------------------------------------------------------
def test_missing_library_is_precise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(libnrt.ENV_LIBNRT, "/nonexistent/libnrt.so.1")
    libnrt.reset()
    with pytest.raises(libnrt.LibnrtNotFound, match=r"/nonexistent/libnrt.so.1.*KVFERRY_LIBNRT"):
        libnrt.load()
    libnrt.reset()


def test_lifecycle_status_codes(fresh_nrt: libnrt.Libnrt) -> None:
    with pytest.raises(libnrt.NrtStateError, match="NRT_UNINITIALIZED"):
        fresh_nrt.tensor_allocate(64)
    fresh_nrt.init()
    h = fresh_nrt.tensor_allocate(64, vnc=3)
    assert fresh_nrt.tensor_get_size(h) == 64
    fresh_nrt.tensor_free(h)
    fresh_nrt.close()
    with pytest.raises(libnrt.NrtStateError, match="NRT_CLOSED") as e:
        fresh_nrt.tensor_allocate(64)
    assert e.value.status == 14 and e.value.func == "nrt_tensor_allocate"


def test_status_codes_map_to_exceptions(nrt: libnrt.Libnrt, monkeypatch: pytest.MonkeyPatch,
                                        fresh_nrt: libnrt.Libnrt) -> None:
    with pytest.raises(libnrt.NrtInvalidError, match="NRT_INVALID"):
        nrt.tensor_allocate(0)
    monkeypatch.setenv("FAKE_NRT_MAX_BYTES", "1024")
    with pytest.raises(MemoryError, match="NRT_RESOURCE"):
        nrt.tensor_allocate(4096)
    monkeypatch.setenv("FAKE_NRT_FAIL_INIT", "6")
    with pytest.raises(libnrt.NrtHardwareError, match="NRT_HW_ERROR"):
        fresh_nrt.init()
    monkeypatch.setenv("FAKE_NRT_FAIL_INIT", "777")
    with pytest.raises(libnrt.NrtError, match=r"unknown NRT_STATUS \(777\)"):
        fresh_nrt.init()
    h = nrt.tensor_allocate(16)
    buf = ctypes.create_string_buffer(32)
    with pytest.raises(libnrt.NrtInvalidError, match="nrt_tensor_read"):
        nrt.tensor_read(h, ctypes.addressof(buf), 8, 16)  # past the end
    nrt.tensor_free(h)


def test_va_is_the_memory(nrt: libnrt.Libnrt) -> None:
    t = NrtTensor.allocate((4, 8), 1, vnc=2, lib=nrt)
    data = fill(t, 3)
    assert ctypes.string_at(t.va, t.nbytes) == data  # fake VA == host address
    assert read(t) == data
    assert nrt.get_attached_efa_bdf(t.va + 5) == "0000:10:1c.0"
    t.free()
    assert t.handle == 0


# -- backend -------------------------------------------------------------------------------
def test_get_backend_neuron_is_lazy_import(monkeypatch: pytest.MonkeyPatch) -> None:
    b = get_backend("neuron")
    assert isinstance(b, NeuronBackend)
    assert (b.name, b.mem_type, b.default_nixl_backends) == ("neuron", VRAM, ("LIBFABRIC",))


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
    assert b.efa_bdf == {0: "0000:10:1c.0", 1: "0000:10:1c.0", 2: "0000:11:1c.0", 3: "0000:11:1c.0"}
    assert b.rails() == {"0000:10:1c.0", "0000:11:1c.0"}
    assert layout.signature()[0] == BS
    assert [nbytes for nbytes, _fmt in layout.signature()[1]] == [BLOCK_BYTES] * 4


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


def test_efa_bdf_failure_falls_back_to_all_rails(nrt: libnrt.Libnrt, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    k, v = kv_pair(nrt, 0)
    monkeypatch.setenv("FAKE_NRT_FAIL_EFA", "1")
    b = NeuronBackend(staging="device")
    with caplog.at_level(logging.WARNING, "kvferry.neuron.backend"):
        b.describe({"l": (k, v)}, NB, BS)
    assert b.efa_bdf == {0: None, 1: None} and b.rails() is None
    assert "using all rails" in caplog.text and "NRT_FAILURE" in caplog.text
    # Memory libnrt does not know (not Neuron HBM): NRT_INVALID, also all rails.
    monkeypatch.delenv("FAKE_NRT_FAIL_EFA")
    host = ctypes.create_string_buffer(NB * 64)
    b.describe({"h": View(ctypes.addressof(host), (NB, 64), 1, 0, NB * 64)}, NB, BS)
    assert b.efa_bdf == {0: None}


def test_describe_errors(nrt: libnrt.Libnrt) -> None:
    b = NeuronBackend(staging="device")
    with pytest.raises(TypeError, match="not a Neuron KV array"):
        b.describe({"l": object()}, NB, BS)
    k, v = kv_pair(nrt, 0)
    with pytest.raises(ValueError, match="num_blocks=7"):
        b.describe({"l": (k, v)}, 7, BS)
    with pytest.raises(ValueError, match=r"\(K, V\) pair"):
        b.describe({"l": (k, v, k)}, NB, BS)
    with pytest.raises(ValueError, match="allocation"):
        b.describe({"l": View(k.va, (NB * 2, BS, HEADS, DIM), ES, 0, k.nbytes)}, NB * 2, BS)
    with pytest.raises(ValueError, match="neuron_staging"):
        NeuronBackend(staging="gpu")
    with pytest.raises(ValueError, match="neuron_staging"):
        NeuronBackend().configure({"neuron_staging": "sometimes"})


def test_auto_mode_picks_by_probe(nrt: libnrt.Libnrt, caplog: pytest.LogCaptureFixture) -> None:
    caches = {"l": kv_pair(nrt, 0)}
    b = NeuronBackend(staging="auto", probe=lambda: [])
    assert b.describe(caches, NB, BS).regions[0].mem_type == VRAM and b.mode == "device"
    b = NeuronBackend(staging="auto", probe=lambda: ["libfabric.so.1 not found"])
    with caplog.at_level(logging.WARNING):
        lay = b.describe(caches, NB, BS)
    assert b.mode == "host" and b.nixl_backends == ("UCX",)
    assert {r.mem_type for r in lay.regions} == {DRAM}
    assert "host staging" in caplog.text
    b.staging.close()


def test_configure_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFERRY_NEURON_STAGING", "host")
    assert NeuronBackend().staging_mode == "host"
    assert NeuronBackend().configure({"neuron_staging": "device"}).staging_mode == "device"


# -- host staging --------------------------------------------------------------------------
def test_host_staging_round_trip_is_byte_exact(nrt: libnrt.Libnrt,
                                               caplog: pytest.LogCaptureFixture) -> None:
    k, v = kv_pair(nrt, 1)
    dk, dv = fill(k, 1), fill(v, 2)
    b = NeuronBackend(staging="host")
    lay = b.describe({"l": (k, v)}, NB, BS)
    st = b.staging
    assert b.mode == "host" and all(r.mem_type == DRAM for r in lay.regions)
    assert b.efa_bdf == {0: "0000:10:1c.0", 1: "0000:10:1c.0"}  # rail of the mirrored HBM
    with caplog.at_level(logging.INFO, "kvferry.neuron.staging"):
        nbytes, ms = st.stage_out([5, 1, 2])
    assert nbytes == 2 * 3 * BLOCK_BYTES and ms >= 0
    assert f"d2h: {nbytes} bytes" in caplog.text
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


def test_host_staging_injected_copy(nrt: libnrt.Libnrt) -> None:
    calls = []
    host = ctypes.create_string_buffer(NB * 64)
    arr = View(ctypes.addressof(host), (NB, 64), 1, 0, NB * 64)
    b = NeuronBackend(staging="host", copy=lambda *a: calls.append(a))
    b.describe({"x": arr}, NB, BS)
    b.staging.stage_out([0, 1, 2, 6])
    assert [(d, off, n) for d, _, off, _, n in calls] == [("d2h", 0, 192), ("d2h", 384, 64)]
    b.staging.close()


def test_fall_back_to_host_after_describe(nrt: libnrt.Libnrt) -> None:
    b = NeuronBackend(staging="device")
    b.describe({"l": kv_pair(nrt, 0)}, NB, BS)
    lay = b.fall_back_to_host("fi_mr_regattr failed")
    assert b.mode == "host" and lay.regions[0].mem_type == DRAM
    b.staging.close()


# -- envcheck ------------------------------------------------------------------------------
def test_envcheck_findings(nrt: libnrt.Libnrt, tmp_path: Path) -> None:
    assert envcheck.check_libnrt().status == envcheck.OK
    f = envcheck.check_libfabric("/nonexistent/libfabric.so.1")
    assert f.blocking and "unusable" in f.detail and "EFA installer" in f.fix
    bad = envcheck.check_shm(True, {})
    assert bad.blocking and "FI_EFA_ENABLE_SHM_TRANSFER=0" in bad.fix
    assert envcheck.check_shm(True, {"FI_EFA_ENABLE_SHM_TRANSFER": "0"}).status == envcheck.OK
    assert envcheck.check_shm(False, {}).status == envcheck.OK
    assert "FI_EFA_USE_DEVICE_RDMA=1" in envcheck.check_hmem({}).fix
    sysfs = tmp_path / "ib"
    (sysfs / "rdmap16s27" / "device").mkdir(parents=True)
    (tmp_path / "drivers" / "efa").mkdir(parents=True)
    os.symlink(tmp_path / "drivers" / "efa", sysfs / "rdmap16s27" / "device" / "driver")
    ok = envcheck.check_efa_devices(str(sysfs))
    assert ok.status == envcheck.OK and "rdmap16s27" in ok.detail
    (tmp_path / "empty").mkdir()
    if not shutil.which("fi_info"):
        assert envcheck.check_efa_devices(str(tmp_path / "empty")).blocking


def test_envcheck_main_exit_code(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(envcheck, "run_checks", lambda *a, **k: [
        envcheck.Finding("libfabric", envcheck.MISSING, "1.17 < 1.21", "install EFA", True)])
    assert envcheck.main([]) == 1
    assert "[FAIL] libfabric" in capsys.readouterr().out
    monkeypatch.setattr(envcheck, "run_checks", lambda *a, **k: [
        envcheck.Finding("libnrt", envcheck.OK, "loaded")])
    assert envcheck.main(["--json"]) == 0


def test_init_order_runs_runtime_first(nrt: libnrt.Libnrt, monkeypatch: pytest.MonkeyPatch) -> None:
    nrt._initialized = False
    monkeypatch.setattr(envcheck, "find_library", lambda *a, **k: None)
    lib, path = envcheck.init_order()
    assert lib is nrt and nrt.initialized and path is None
    monkeypatch.setattr(envcheck, "libfabric_loaded", lambda: "/usr/lib/libfabric.so.1")
    nrt._initialized = False
    with pytest.raises(RuntimeError, match="before nrt_init"):
        envcheck.init_order()
    assert envcheck.check_init_order().blocking


def test_real_host_report_runs(nrt: libnrt.Libnrt) -> None:
    """The full report on this machine: every check answers, nothing raises."""
    findings = envcheck.run_checks(colocated=True, env={"FI_EFA_USE_DEVICE_RDMA": "1"})
    names = [f.check for f in findings]
    assert names[:2] == ["libnrt", "init-order"] and "libfabric" in names and "efa-shm" in names
    assert all(f.status in (envcheck.OK, envcheck.MISSING, envcheck.WARN) for f in findings)


def test_unresolved_names_missing_libraries_and_symbol_versions() -> None:
    """Measured here: NIXL 1.5.1's plugin with libfabric 2.1.0 (Debian's newest, built from
    source) loads the library but lacks the FABRIC_1.10 fi_getinfo ABI; the check says so."""
    ldd = ("/x/libplugin_LIBFABRIC.so: /opt/lf/lib/libfabric.so.1: version `FABRIC_1.10' not "
           "found (required by /x/libplugin_LIBFABRIC.so)\n"
           "\tlinux-vdso.so.1 (0x00007ffd)\n"
           "\tlibfabric.so.1 => /opt/lf/lib/libfabric.so.1 (0x00007f)\n"
           "\tlibcuda.so.1 => not found\n")
    assert envcheck.unresolved(ldd) == ["FABRIC_1.10 (not in libfabric.so.1)", "libcuda.so.1"]
    assert envcheck.unresolved("\tlibc.so.6 => /lib/libc.so.6 (0x1)\n") == []
