"""Host-staged KV transfer through the real transfer path: TransferWorkers over NIXL (UCX).

Each engine's KV lives in fake-libnrt "device" arrays; NeuronBackend(staging="host") gives
the workers the pinned DRAM mirror as their layout and its HostStaging object. The bytes
must go device -> stage_out -> NIXL -> peer mirror -> stage_in -> peer device, for a pull
READ (P staged by `save`, as wait_for_save does), a push WRITE, and a reuse READ, and
arrive byte-exact on the peer's device arrays while every other block stays untouched.
"""

from __future__ import annotations

import ctypes
import time
import uuid
from collections.abc import Callable

import pytest
from fakes.nrt_runtime import FakeRuntime, build
from helpers_http import free_port
from helpers_lease import LEASE_ID, held_lease

from kvferry.connectors.config import ConnectorConfig
from kvferry.connectors.memory.backends import CpuBackend
from kvferry.connectors.protocol.params import SECRET_ENV
from kvferry.connectors.protocol.step import ReuseRead, StepMeta
from kvferry.connectors.scheduling.scheduler import TransferScheduler
from kvferry.connectors.transfer.results import Results
from kvferry.connectors.transfer.worker import TransferWorker
from kvferry.neuron import libnrt
from kvferry.neuron.backend import NeuronBackend
from kvferry.neuron.libnrt import NrtTensor

pytest.importorskip("nixl._api")
pytestmark = pytest.mark.timeout(90)

NB, BS, HEADS, DIM, ES = 8, 16, 2, 32, 2
BLOCK_BYTES = BS * HEADS * DIM * ES
PROMPT = list(range(1, 40))  # 39 tokens -> 3 blocks
P_BLOCKS, D_BLOCKS = [5, 1, 6], [0, 7, 3]


@pytest.fixture(scope="module")
def nrt(tmp_path_factory: pytest.TempPathFactory):
    """The FAKE runtime, started by the "framework" with HBM not mapped: device VAs are
    not host memory, so every byte must go through the host mirrors."""
    out = build(tmp_path_factory.mktemp("fake_nrt_staged") / "libnrt.so.1")
    mp = pytest.MonkeyPatch()
    mp.setenv(libnrt.ENV_LIBNRT, str(out))
    mp.setenv("NEURON_RT_MAP_HBM", "0")
    libnrt.reset()
    rt = FakeRuntime(out)
    rt.start(map_hbm=False)
    yield libnrt.load()
    rt.reset()
    libnrt.reset()
    mp.undo()


def dev_bytes(t: NrtTensor) -> bytes:
    buf = ctypes.create_string_buffer(t.nbytes)
    t.lib.tensor_read(t.handle, ctypes.addressof(buf), 0, t.nbytes)
    return buf.raw


class Engine:
    """Two layers of (K, V) fake device arrays, host-staged, behind a real TransferWorker."""

    def __init__(self, lib: libnrt.Libnrt, role: str, seed: int, vnc: int):
        self.arrays: list[NrtTensor] = []
        caches = {}
        for layer in range(2):
            pair = []
            for kv in range(2):
                t = NrtTensor.allocate((NB, BS, HEADS, DIM), ES, vnc, f"{role}{layer}{kv}", lib)
                data = bytes((seed + layer * 13 + kv * 5 + i) % 251 for i in range(t.nbytes))
                buf = ctypes.create_string_buffer(data, len(data))
                lib.tensor_write(t.handle, ctypes.addressof(buf), 0, len(data))
                pair.append(t)
            caches[f"layer.{layer}"] = tuple(pair)
            self.arrays += pair
        self.backend = NeuronBackend(staging="host")
        layout = self.backend.describe(caches, NB, BS)
        self.engine_id = f"{role}-{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.cfg = ConnectorConfig(hardware_backend="neuron", neuron_staging="host",
                                   side_channel_port=self.port, handshake_timeout_s=15.0)
        self.worker = TransferWorker(self.cfg, self.engine_id, 0, layout, ["UCX"],
                                     staging=self.backend.staging)
        self.sched = TransferScheduler(self.engine_id, "127.0.0.1", self.port, BS, stage_saves=True)
        self.acc = Results()
        self.before = self.snapshot()

    def snapshot(self) -> list[bytes]:
        return [dev_bytes(t) for t in self.arrays]

    def mirror_block(self, plane: int, block: int) -> bytes:
        p = self.worker.transport.layout.planes[plane]
        return ctypes.string_at(p.block_addr(block), p.block_bytes)

    def collect(self, until: Callable[[Results], bool], timeout: float = 20) -> Results:
        deadline = time.monotonic() + timeout
        while True:
            r = self.worker.results()
            self.acc.sent |= r.sent
            self.acc.recvd |= r.recvd
            self.acc.bad_blocks |= r.bad_blocks
            if until(self.acc) or time.monotonic() >= deadline:
                return self.acc
            time.sleep(0.005)

    def close(self) -> None:
        self.worker.close()
        self.backend.staging.close()


@pytest.fixture
def engines(nrt, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "staged-transfer-secret")
    made: list[Engine] = []

    def make(role: str, seed: int, vnc: int) -> Engine:
        made.append(Engine(nrt, role, seed, vnc))
        return made[-1]

    yield make
    for e in made:
        e.close()


def block(data: bytes, b: int) -> bytes:
    return data[b * BLOCK_BYTES:(b + 1) * BLOCK_BYTES]


def assert_moved(src: Engine, dst: Engine, src_ids: list[int], dst_ids: list[int]) -> None:
    """dst's device blocks dst_ids hold src's device blocks src_ids; nothing else changed."""
    for s_arr, d_arr, d_before in zip(src.arrays, dst.arrays, dst.before, strict=True):
        s, d = dev_bytes(s_arr), dev_bytes(d_arr)
        for sb, db in zip(src_ids, dst_ids, strict=True):
            assert block(d, db) == block(s, sb)
        for db in set(range(NB)) - set(dst_ids):
            assert block(d, db) == block(d_before, db)
    assert src.snapshot() == src.before  # the source device was only read


def test_pull_read_device_to_device_through_host_mirrors(engines):
    p, d = engines("P", seed=1, vnc=0), engines("D", seed=90, vnc=4)
    # P's scheduler: the prompt's forward is this step -> its blocks go in StepMeta.save
    p.sched.after_alloc("p-req", P_BLOCKS, 0, {"do_remote_decode": True})
    p.sched.plan_saves({"p-req": (0, len(PROMPT))})
    step = p.sched.take_meta()
    assert step.save == P_BLOCKS
    assert p.mirror_block(0, P_BLOCKS[0]) != block(p.before[0], P_BLOCKS[0])  # mirror stale
    p.worker.save(step.save)  # what wait_for_save does, before request_finished runs
    assert p.mirror_block(0, P_BLOCKS[0]) == block(p.before[0], P_BLOCKS[0])
    keep, offer = p.sched.finished("p-req", True, P_BLOCKS, {"do_remote_decode": True}, PROMPT)
    assert keep
    p.worker.submit(p.sched.take_meta())

    count, is_async = d.sched.matched_tokens("d-req", PROMPT, offer, 0)
    assert is_async and count == len(PROMPT)
    d.sched.after_alloc("d-req", D_BLOCKS, count)
    d.worker.submit(d.sched.take_meta())
    got = d.collect(lambda r: "d-req" in r.recvd)
    assert got.recvd == {"d-req"} and got.bad_blocks == set()
    assert_moved(p, d, P_BLOCKS, D_BLOCKS)
    assert d.backend.staging.stats.bytes == len(D_BLOCKS) * BLOCK_BYTES * len(d.arrays)
    assert "p-req" in p.collect(lambda r: "p-req" in r.sent).sent  # D's Done freed P


def test_push_write_device_to_device_through_host_mirrors(engines):
    p, d = engines("P", seed=3, vnc=1), engines("D", seed=70, vnc=2)
    tid = f"t-{uuid.uuid4().hex[:8]}"
    params = {"do_remote_prefill": True, "push": True, "transfer_id": tid,
              "remote_host": "127.0.0.1", "remote_port": p.port}
    count, is_async = d.sched.matched_tokens("d-req", PROMPT, params, 0)
    assert is_async
    d.sched.after_alloc("d-req", D_BLOCKS, count)
    d.worker.submit(d.sched.take_meta())  # D registers its destination blocks with P

    p.sched.after_alloc("p-req", P_BLOCKS, 0, {"do_remote_decode": True, "push": True})
    p.sched.plan_saves({"p-req": (0, len(PROMPT))})
    assert p.sched.take_meta().save == []  # push: P stages on the transfer thread instead
    keep, _ = p.sched.finished("p-req", True, P_BLOCKS,
                               {"do_remote_decode": True, "push": True, "transfer_id": tid}, PROMPT)
    assert keep and p.mirror_block(0, P_BLOCKS[0]) != block(p.before[0], P_BLOCKS[0])
    p.worker.submit(p.sched.take_meta())  # prefill done: the WRITE starts once matched

    got = d.collect(lambda r: "d-req" in r.recvd)
    assert got.recvd == {"d-req"} and got.bad_blocks == set()
    assert_moved(p, d, P_BLOCKS, D_BLOCKS)
    assert "p-req" in p.collect(lambda r: "p-req" in r.sent).sent


def test_reuse_read_lands_on_the_device(engines):
    """P READs D's leased history (a device-mode D in production; here D's mirror is
    staged by hand) and must have it on its device before reporting it received."""
    p, d = engines("P", seed=5, vnc=0), engines("D", seed=40, vnc=3)
    d.worker.save([2, 4])
    with held_lease([2, 4]) as (_, control_port):
        rr = ReuseRead("p-req", [6, 0], [2, 4], d.engine_id, d.worker.instance, "127.0.0.1",
                       d.port, time.time() + 10, lease_id=LEASE_ID, control_port=control_port)
        p.worker.submit(StepMeta(reuse=[rr]))
        got = p.collect(lambda r: "p-req" in r.recvd)
    assert got.recvd == {"p-req"} and got.bad_blocks == set()
    assert_moved(d, p, [2, 4], [6, 0])


class FailingStaging:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int]]] = []

    def stage_out(self, block_ids):
        self.calls.append(("out", list(block_ids)))

    def stage_in(self, block_ids):
        self.calls.append(("in", list(block_ids)))
        raise OSError("nrt_tensor_write: NRT_HW_ERROR")


def test_failed_stage_in_reports_the_blocks_bad(monkeypatch):
    """A READ that arrived but could not reach the device must end in a recompute."""
    monkeypatch.setenv(SECRET_ENV, "staged-transfer-secret")
    torch = pytest.importorskip("torch")
    workers, scheds = [], []
    for _ in range(2):
        kv = {"l0": torch.arange(2 * NB * 64, dtype=torch.float32).reshape(2, NB, 64)}
        port = free_port()
        cfg = ConnectorConfig(side_channel_port=port, handshake_timeout_s=2.0)
        eid = f"cpu-{uuid.uuid4().hex[:8]}"
        staging = FailingStaging() if workers else None
        workers.append(TransferWorker(cfg, eid, 0, CpuBackend().describe(kv, NB, BS),
                                      staging=staging))
        scheds.append(TransferScheduler(eid, "127.0.0.1", port, BS))
    try:
        (p, d), (ps, ds) = workers, scheds
        assert not p.mirror.active
        p.save([1])  # no staging: a no-op
        _, offer = ps.finished("p", True, P_BLOCKS, {"do_remote_decode": True}, PROMPT)
        p.submit(ps.take_meta())
        count, _ = ds.matched_tokens("d", PROMPT, offer, 0)
        ds.after_alloc("d", D_BLOCKS, count)
        d.submit(ds.take_meta())
        acc = Results()
        deadline = time.monotonic() + 20
        while "d" not in acc.recvd and time.monotonic() < deadline:
            r = d.results()
            acc.recvd |= r.recvd
            acc.bad_blocks |= r.bad_blocks
            time.sleep(0.005)
        assert acc.recvd == {"d"} and acc.bad_blocks == set(D_BLOCKS)
        assert d.mirror.staging.calls == [("in", D_BLOCKS)]
    finally:
        for w in workers:
            w.close()


def test_mirror_pairs_with_a_device_layout(engines):
    """A host-staged engine and a device-mode peer must pass the layout check (mixed modes):
    the mirror keeps each plane's block format, not just its byte count."""
    e = engines("X", seed=9, vnc=0)
    caches = {f"layer.{i}": (e.arrays[2 * i], e.arrays[2 * i + 1]) for i in range(2)}
    device = NeuronBackend(staging="device").describe(caches, NB, BS)
    assert e.worker.transport.layout.signature() == device.signature()
    assert all(p.fmt for p in device.planes)
