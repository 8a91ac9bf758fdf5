"""Real NIXL transfers between fake-"device" Neuron regions (two agents, one process).

The fake libnrt hands out host memory, so UCX can move it as DRAM: this shows that the
regions/planes NeuronBackend builds address exactly the right bytes, with a real NIXL
READ, on both the device path and the host-staged path. The LIBFABRIC variant (what
Neuron HBM really uses) needs libfabric >= 1.21 and skips with the reason otherwise.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from kvferry.connectors.memory import DRAM, KVLayout
from kvferry.neuron import envcheck, libnrt
from kvferry.neuron.backend import NeuronBackend
from kvferry.neuron.libnrt import NrtTensor

nixl_api = pytest.importorskip("nixl._api")

FAKE_SRC = Path(__file__).parent / "fakes" / "fake_libnrt.c"
NB, BS, HEADS, DIM, ES = 8, 16, 2, 32, 2
BLOCK_BYTES = BS * HEADS * DIM * ES


@pytest.fixture(scope="module")
def nrt(tmp_path_factory: pytest.TempPathFactory):
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc not found: cannot build the fake libnrt (tests/fakes/fake_libnrt.c)")
    out = tmp_path_factory.mktemp("fake_nrt_nixl") / "libnrt.so.1"
    subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-o", str(out), str(FAKE_SRC)], check=True)
    mp = pytest.MonkeyPatch()
    mp.setenv(libnrt.ENV_LIBNRT, str(out))
    libnrt.reset()
    lib = libnrt.load()
    lib.init()
    yield lib
    libnrt.reset()
    mp.undo()


def engine(lib: libnrt.Libnrt, seed: int, vnc: int) -> dict[str, tuple[NrtTensor, NrtTensor]]:
    caches = {}
    for layer in range(2):
        pair = []
        for kv in range(2):
            t = NrtTensor.allocate((NB, BS, HEADS, DIM), ES, vnc, f"l{layer}{kv}", lib)
            data = bytes((seed + layer * 13 + kv * 5 + i) % 253 for i in range(t.nbytes))
            buf = ctypes.create_string_buffer(data, len(data))
            lib.tensor_write(t.handle, ctypes.addressof(buf), 0, len(data))
            pair.append(t)
        caches[f"layer.{layer}"] = (pair[0], pair[1])
    return caches


def dev_bytes(t: NrtTensor) -> bytes:
    buf = ctypes.create_string_buffer(t.nbytes)
    t.lib.tensor_read(t.handle, ctypes.addressof(buf), 0, t.nbytes)
    return buf.raw


_names = iter(range(1_000_000))


def agents(backend: str = "UCX"):
    cfg = nixl_api.nixl_agent_config(backends=[backend])
    n = next(_names)
    return nixl_api.nixl_agent(f"neuron-P{n}", cfg), nixl_api.nixl_agent(f"neuron-D{n}", cfg)


def register(agent, layout: KVLayout) -> None:
    # Fake HBM is host memory: register as DRAM (real HBM goes through LIBFABRIC as VRAM).
    agent.register_memory([(r.addr, r.length, r.device_id, "") for r in layout.regions], DRAM)


def read_blocks(d, p, p_layout: KVLayout, d_layout: KVLayout, p_ids: list[int], d_ids: list[int]) -> None:
    """D READs P's blocks p_ids into its blocks d_ids, every plane, one NIXL request."""
    local, remote = [], []
    for pp, dp in zip(p_layout.planes, d_layout.planes, strict=True):
        assert pp.block_bytes == dp.block_bytes
        for pb, db in zip(p_ids, d_ids, strict=True):
            local.append((dp.block_addr(db), dp.block_bytes, d_layout.regions[dp.region].device_id))
            remote.append((pp.block_addr(pb), pp.block_bytes, p_layout.regions[pp.region].device_id))
    h = d.initialize_xfer("READ", d.get_xfer_descs(local, DRAM), d.get_xfer_descs(remote, DRAM),
                          p.name, b"kv-done")
    assert d.transfer(h) in ("PROC", "DONE")
    deadline = time.monotonic() + 20
    while (state := d.check_xfer_state(h)) != "DONE":
        assert state != "ERR" and time.monotonic() < deadline, state
        time.sleep(0.001)
    d.release_xfer_handle(h)


def check_blocks(p_caches, d_caches, p_ids, d_ids, untouched_d: dict[str, bytes]) -> None:
    for layer in p_caches:
        for pt, dt in zip(p_caches[layer], d_caches[layer], strict=True):
            src, dst, before = dev_bytes(pt), dev_bytes(dt), untouched_d[f"{layer}{id(dt)}"]
            for pb, db in zip(p_ids, d_ids, strict=True):
                assert dst[db * BLOCK_BYTES:(db + 1) * BLOCK_BYTES] == \
                    src[pb * BLOCK_BYTES:(pb + 1) * BLOCK_BYTES]
            for db in set(range(NB)) - set(d_ids):
                assert dst[db * BLOCK_BYTES:(db + 1) * BLOCK_BYTES] == \
                    before[db * BLOCK_BYTES:(db + 1) * BLOCK_BYTES]


def snapshot(caches) -> dict[str, bytes]:
    return {f"{layer}{id(t)}": dev_bytes(t) for layer, kv in caches.items() for t in kv}


def test_nixl_read_between_fake_device_regions(nrt: libnrt.Libnrt) -> None:
    p_caches, d_caches = engine(nrt, 1, vnc=0), engine(nrt, 100, vnc=8)
    pb, db = NeuronBackend(staging="device"), NeuronBackend(staging="device")
    p_lay, d_lay = pb.describe(p_caches, NB, BS), db.describe(d_caches, NB, BS)
    assert p_lay.signature() == d_lay.signature()
    assert set(db.efa_bdf.values()) == {"0000:12:1c.0"}  # vnc 8 -> third rail in the fake
    p, d = agents()
    register(p, p_lay)
    register(d, d_lay)
    d.add_remote_agent(p.get_agent_metadata())
    p.add_remote_agent(d.get_agent_metadata())
    before = snapshot(d_caches)
    read_blocks(d, p, p_lay, d_lay, [0, 3, 4], [7, 1, 2])
    check_blocks(p_caches, d_caches, [0, 3, 4], [7, 1, 2], before)


def test_nixl_read_host_staged(nrt: libnrt.Libnrt) -> None:
    """P stages HBM -> pinned DRAM, D READs P's mirror into its mirror, D stages -> HBM."""
    p_caches, d_caches = engine(nrt, 7, vnc=1), engine(nrt, 200, vnc=2)
    pb, db = NeuronBackend(staging="host"), NeuronBackend(staging="host")
    p_lay, d_lay = pb.describe(p_caches, NB, BS), db.describe(d_caches, NB, BS)
    assert {r.mem_type for r in p_lay.regions + d_lay.regions} == {DRAM}
    p, d = agents()
    register(p, p_lay)
    register(d, d_lay)
    d.add_remote_agent(p.get_agent_metadata())
    before = snapshot(d_caches)
    pb.staging.stage_out([2, 5])
    read_blocks(d, p, p_lay, d_lay, [2, 5], [0, 6])
    db.staging.stage_in([0, 6])
    check_blocks(p_caches, d_caches, [2, 5], [0, 6], before)
    pb.staging.close()
    db.staging.close()


def _libfabric_skip_reason() -> str | None:
    """Why the LIBFABRIC variant cannot run here, in the words of kvferry's own checks.

    Measured on the CI machine (Debian 12): libfabric 1.17 is too old; libfabric 2.1.0
    (Debian's newest, built from source) loads but lacks FABRIC_1.10, the fi_getinfo ABI
    NIXL 1.5.1's plugin was linked against, and the plugin also needs libcuda.so.1.
    """
    f = envcheck.check_libfabric()
    if f.status != envcheck.OK:
        return f"NIXL LIBFABRIC backend unusable: {f.detail}"
    p = envcheck.check_nixl_plugin()
    if p.status != envcheck.OK:
        return f"NIXL LIBFABRIC plugin unusable: {p.detail}"
    return None


@pytest.mark.skipif(_libfabric_skip_reason() is not None, reason=str(_libfabric_skip_reason()))
def test_nixl_libfabric_read(nrt: libnrt.Libnrt) -> None:
    p_caches, d_caches = engine(nrt, 3, vnc=0), engine(nrt, 50, vnc=4)
    p_lay = NeuronBackend(staging="device").describe(p_caches, NB, BS)
    d_lay = NeuronBackend(staging="device").describe(d_caches, NB, BS)
    p, d = agents("LIBFABRIC")
    register(p, p_lay)
    register(d, d_lay)
    d.add_remote_agent(p.get_agent_metadata())
    before = snapshot(d_caches)
    read_blocks(d, p, p_lay, d_lay, [1], [5])
    check_blocks(p_caches, d_caches, [1], [5], before)
