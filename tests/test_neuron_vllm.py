"""kvferry's connector on a FAKE vllm-neuron platform (tests/fakes/vllm_neuron.py), over real
NIXL (UCX on DRAM; no Neuron device or LIBFABRIC here).

Each engine is one fake vllm-neuron worker (one TP rank per process): device type
``neuron``, ``get_nixl_supported_devices() == {"neuron": {"cuda"}}``, KV handed to the
connector as ``{layer: tensor (2, num_blocks, kv_heads, 32, head_size)}`` (CPU stand-ins
of the real shape and dtype). The connector's real path runs: register_kv_caches ->
NeuronBackend.describe -> registration (with its fallback) -> TransferWorker, then pull
READs, push WRITEs and reuse READs driven through start_load_kv / wait_for_save /
get_finished, compared byte for byte.
"""

from __future__ import annotations

import time
import uuid

import pytest
import torch
from fakes.vllm_neuron import (
    FakeNeuronAttentionBackend,
    FakeNeuronPlatform,
    FakeNeuronWorker,
    Model,
)
from helpers_http import free_port
from helpers_lease import LEASE_ID, held_lease

from kvferry.connectors.memory.backends import DRAM
from kvferry.connectors.protocol.params import SECRET_ENV
from kvferry.connectors.protocol.step import ReuseRead, StepMeta
from kvferry.connectors.scheduling.scheduler import TransferScheduler
from kvferry.neuron.backend import ENV_STAGING, NeuronBackend, RegistrationError

pytest.importorskip("nixl._api")
pytestmark = pytest.mark.timeout(120)

BS = FakeNeuronPlatform.UNIFORM_NEURON_PAGE
NB = 12
PROMPT = list(range(1, 90))  # 89 tokens -> 3 blocks of 32
P_BLOCKS, D_BLOCKS = [5, 1, 6], [0, 7, 3]


class Engine:
    """One fake vllm-neuron engine: its worker ranks and kvferry's scheduler side."""

    def __init__(self, mp: pytest.MonkeyPatch, role: str, mode: str, seed: int | None,
                 tp: int = 1, model: Model | None = None, **extra: object) -> None:
        self.engine_id = f"{role}-{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.model = model or Model()
        cfg = {"hardware_backend": "neuron", "neuron_staging": mode, "nixl_backends": ["UCX"],
               "side_channel_port": self.port, "handshake_timeout_s": 15.0, **extra}
        self.ranks = [FakeNeuronWorker(self.engine_id, cfg, mp, rank=r, tp_size=tp,
                                       num_blocks=NB, model=self.model, seed=seed)
                      for r in range(tp)]
        for w in self.ranks:
            w.register()
        self.sched = TransferScheduler(self.engine_id, "127.0.0.1", self.port, BS, tp,
                                       stage_saves=self.backend.may_stage,
                                       num_kv_heads=self.model.kv_heads)
        self.before = self.snapshot()

    @property
    def worker(self) -> FakeNeuronWorker:
        return self.ranks[0]

    @property
    def backend(self) -> NeuronBackend:
        return self.worker.backend

    def snapshot(self) -> list[dict[str, torch.Tensor]]:
        return [{k: t.clone() for k, t in w.kv.items()} for w in self.ranks]

    def step(self, meta: StepMeta | None = None) -> None:
        for w in self.ranks:  # vLLM hands every rank the same metadata
            w.step(meta)

    def wait(self, what: str, req_id: str) -> None:
        assert all(w.run_until(what, req_id) for w in self.ranks), (what, req_id)

    def close(self) -> None:
        for w in self.ranks:
            w.close()


@pytest.fixture
def engines(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "fake-vllm-neuron-secret")
    monkeypatch.delenv(ENV_STAGING, raising=False)
    made: list[Engine] = []

    def make(role: str, mode: str, seed: int | None = None, **kw: object) -> Engine:
        made.append(Engine(monkeypatch, role, mode, seed, **kw))
        return made[-1]

    yield make
    for e in made:
        e.close()


def assert_moved(src: Engine, dst: Engine, src_ids: list[int], dst_ids: list[int]) -> None:
    """dst's blocks dst_ids hold src's blocks src_ids in every layer's K and V; every other
    block of dst is as it was, and src was only read."""
    (s,), (d,), (before,) = src.snapshot(), dst.snapshot(), dst.before
    for layer in d:
        for kv in range(2):
            for sb, db in zip(src_ids, dst_ids, strict=True):
                assert torch.equal(d[layer][kv, db], s[layer][kv, sb]), (layer, kv, db)
            for db in set(range(NB)) - set(dst_ids):
                assert torch.equal(d[layer][kv, db], before[layer][kv, db]), (layer, kv, db)
    for was, now in zip(src.before, src.snapshot(), strict=True):
        assert all(torch.equal(was[k], now[k]) for k in was)


def pull(p: Engine, d: Engine, p_req: str = "p-req", d_req: str = "d-req") -> None:
    """P prefills (its forward wrote P_BLOCKS), offers them; D READs them into D_BLOCKS."""
    params = {"do_remote_decode": True}
    p.sched.after_alloc(p_req, P_BLOCKS, 0, params)
    if p.sched.saves is not None:  # host staging may be active: stage what the forward wrote
        p.sched.plan_saves({p_req: (0, len(PROMPT))})
    p.step(p.sched.take_meta())  # wait_for_save stages the blocks when host-staged
    keep, offer = p.sched.finished(p_req, True, P_BLOCKS, params, PROMPT)
    assert keep and offer
    p.step(p.sched.take_meta())
    count, is_async = d.sched.matched_tokens(d_req, PROMPT, offer, 0)
    assert is_async and count == len(PROMPT), d.sched.rejection(d_req)
    d.sched.after_alloc(d_req, D_BLOCKS, count)
    d.step(d.sched.take_meta())
    d.wait("recvd", d_req)
    p.wait("sent", p_req)  # D's Done freed P's blocks


def push(p: Engine, d: Engine) -> None:
    """D registers its destination blocks with P; P WRITEs when its prefill is done."""
    tid = f"t-{uuid.uuid4().hex[:8]}"
    count, is_async = d.sched.matched_tokens("d-push", PROMPT, {
        "do_remote_prefill": True, "push": True, "transfer_id": tid,
        "remote_host": "127.0.0.1", "remote_port": p.port}, 0)
    assert is_async
    d.sched.after_alloc("d-push", D_BLOCKS, count)
    d.step(d.sched.take_meta())
    p.sched.after_alloc("p-push", P_BLOCKS, 0, {"do_remote_decode": True, "push": True})
    p.step(p.sched.take_meta())
    keep, _ = p.sched.finished("p-push", True, P_BLOCKS, {
        "do_remote_decode": True, "push": True, "transfer_id": tid}, PROMPT)
    assert keep
    p.step(p.sched.take_meta())
    d.wait("recvd", "d-push")
    p.wait("sent", "p-push")


def reuse(p: Engine, d: Engine) -> None:
    """P READs D's (leased) history blocks [2, 4] into its blocks [6, 0]."""
    if d.backend.mode == "host":  # a host-staged D grants no leases; stage by hand
        d.worker.connector._worker.save([2, 4])
    with held_lease([2, 4]) as (_, control_port):
        rr = ReuseRead("p-reuse", [6, 0], [2, 4], d.engine_id, d.worker.connector.instance,
                       "127.0.0.1", d.port, time.time() + 10, lease_id=LEASE_ID,
                       control_port=control_port)
        p.step(StepMeta(reuse=[rr]))
        p.wait("recvd", "p-reuse")


def no_bad_blocks(*engines: Engine) -> None:
    assert all(not w.bad_blocks for e in engines for w in e.ranks)


def test_fake_platform_is_what_vllm_neuron_reports():
    assert FakeNeuronPlatform.device_type == "neuron"
    assert FakeNeuronPlatform.get_nixl_supported_devices() == {"neuron": {"cuda"}}
    assert FakeNeuronAttentionBackend.get_kv_cache_shape(7, 32, 3, 64) == (2, 7, 3, 32, 64)


@pytest.mark.parametrize("mode", ["mapped", "host"])
def test_pull_push_and_reuse_move_the_exact_bytes(engines, mode):
    p, d = engines("P", mode, seed=1), engines("D", mode, seed=2)
    assert (p.backend.mode, d.backend.mode) == (mode, mode)
    layout = p.worker.connector._worker.transport.layout
    assert {r.mem_type for r in layout.regions} == {DRAM}
    if mode == "mapped":  # the tensors' own addresses, as upstream registers data_ptr()
        assert sorted(r.addr for r in layout.regions) == sorted(t.data_ptr()
                                                                for t in p.worker.kv.values())
    else:
        assert p.backend.staging is not None and layout is p.backend.staging.layout
    # the HND layout: heads located at dim 2, K and V planes per layer, 32-token blocks
    assert layout.block_size == BS and len(layout.planes) == 2 * p.model.num_layers
    assert layout.num_heads == p.model.kv_heads

    pull(p, d)
    assert_moved(p, d, P_BLOCKS, D_BLOCKS)
    d_push = engines("Dpush", mode, seed=3)
    push(p, d_push)
    assert_moved(p, d_push, P_BLOCKS, D_BLOCKS)
    p.before, d.before = p.snapshot(), d.snapshot()
    reuse(p, d)  # P reads back D's history: blocks 2 and 4 (seeded, never overwritten)
    assert_moved(d, p, [2, 4], [6, 0])
    no_bad_blocks(p, d, d_push)
    if mode == "host":
        assert d.backend.staging.stats.transfers >= 2 and p.backend.staging.stats.bytes > 0


def test_auto_falls_back_when_nixl_refuses_device_memory(engines):
    """auto tries device first; UCX refuses VRAM that is host memory (as LIBFABRIC refused
    VRAM in AWS's image), so the engine registers mapped HBM as DRAM and still moves KV."""
    p, d = engines("P", "auto", seed=4), engines("D", "auto")
    for e in (p, d):
        assert [(a.mode, a.outcome) for a in e.backend.attempts] == [
            ("device", "failed"), ("mapped", "registered")]
        assert "NIXL_ERR_BACKEND" in e.backend.attempts[0].reason
        assert e.backend.mode == "mapped"
    pull(p, d)
    assert_moved(p, d, P_BLOCKS, D_BLOCKS)
    no_bad_blocks(p, d)


def test_a_pinned_mode_that_nixl_refuses_is_an_error(engines):
    with pytest.raises(RegistrationError, match=r"device/UCX failed: nixlBackendError") as e:
        engines("P", "device")
    assert [(a.mode, a.outcome) for a in e.value.attempts] == [("device", "failed")]


def test_tp2_prefill_to_tp1_decode_reads_each_ranks_heads(engines):
    """Two fake worker processes (ranks 0, 1) of one P engine, one head each; D (TP 1)
    reads each P rank's head of every block: the heads must be located at HND dim 2."""
    p = engines("P", "mapped", seed=5, tp=2)
    d = engines("D", "mapped")
    assert [w.kv[next(iter(w.kv))].shape for w in p.ranks] == [(2, NB, 1, BS, 16)] * 2
    pull(p, d)
    no_bad_blocks(p, d)
    for layer, t in d.worker.kv.items():
        for sb, db in zip(P_BLOCKS, D_BLOCKS, strict=True):
            for r, w in enumerate(p.ranks):
                assert torch.equal(t[:, db, r], w.kv[layer][:, sb, 0]), (layer, r, db)


def test_kv_as_k_v_pairs_registers_and_logs(engines, monkeypatch):
    """A runner that hands {layer: (K, V)} (NxD Inference-style separate K and V): the
    connector describes both planes of every layer (the old log line read .shape off the
    tuple and raised)."""
    monkeypatch.setenv(SECRET_ENV, "fake-vllm-neuron-secret")
    w = FakeNeuronWorker("P-pairs", {"hardware_backend": "neuron", "neuron_staging": "mapped",
                                     "nixl_backends": ["UCX"], "side_channel_port": free_port()},
                         monkeypatch, num_blocks=NB)
    try:
        pairs = {name: (t[0], t[1]) for name, t in w.kv.items()}
        w.register(pairs)
        layout = w.connector._worker.transport.layout
        assert len(layout.planes) == 2 * len(pairs) and w.backend.mode == "mapped"
        k0 = next(iter(pairs.values()))[0]
        assert layout.planes[0].base == k0.data_ptr()
        assert layout.planes[0].block_bytes == k0[0].numel() * k0.element_size()
    finally:
        w.close()
