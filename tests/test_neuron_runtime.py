"""Neuron path, the runtime: the fake libnrt is as strict as the real one (lifecycle, status
codes, which VAs are host memory), and kvferry never starts the runtime.

Against a FAKE libnrt (tests/fakes/fake_libnrt.c) and CPU stand-in tensors; the fake is as
strict as the real runtime where it matters (tests/helpers_neuron.py)."""

from __future__ import annotations

import ctypes

import helpers_neuron
import pytest
from fakes.nrt_runtime import host_readable
from helpers_neuron import BS, NB, fill, kv_pair, read

from kvferry.neuron import envcheck, libnrt
from kvferry.neuron.backend import ENV_MAP_HBM, NeuronBackend
from kvferry.neuron.libnrt import NrtTensor

fake_lib = helpers_neuron.fake_lib
runtime = helpers_neuron.runtime
nrt = helpers_neuron.nrt
private = helpers_neuron.private


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
