"""Layer-wise push: P WRITEs each layer of a prompt's last chunk as soon as its fence
passes; D is told only when every layer landed and the step after the forward began.

Two in-process TransferWorkers over real NIXL (tests/helpers_workers.py: layer l0 has
two planes, K and V; l1 one). FakeFence stands in for the CUDA event save_kv_layer
records behind each layer's kernels.
"""

from __future__ import annotations

import threading
import time
import uuid

import helpers_workers
import numpy as np
import pytest
import torch
from helpers_workers import (
    BS,
    D_BLOCKS,
    P_BLOCKS,
    PROMPT,
    Engine,
    N,
    blocks_of,
    d_register,
    failures,
    settle,
    wait_ranks,
    written,
)

from kvferry.connectors.memory.backends import CpuBackend
from kvferry.connectors.protocol.step import StepMeta
from kvferry.connectors.scheduling.scheduler import TransferScheduler
from kvferry.connectors.transfer.layer_push import Fences, LayerFence
from kvferry.connectors.transfer.layout import descriptors
from kvferry.connectors.transfer.results import Results

engines = helpers_workers.engines
pytestmark = pytest.mark.timeout(60)

PUSH = {"do_remote_decode": True, "push": True, "transfer_id": "t1"}


class FakeFence:
    """Stands in for torch.cuda.Event: query() is True once the 'device' is done."""

    def __init__(self) -> None:
        self.passed = threading.Event()

    def query(self) -> bool:
        return self.passed.is_set()


def layered_p(engines, seed: int, **cfg) -> Engine:
    p = engines("P", seed=seed, layerwise_push=True, **cfg)
    p.sched = TransferScheduler(p.engine_id, "127.0.0.1", p.port, BS, early_push=True)
    assert p.worker.layerwise
    return p


def registered(p: Engine, tid: str = "t1") -> None:
    """P's transfer thread has D's registration (pushes race it otherwise)."""
    deadline = time.monotonic() + 10
    while p.worker.push_write.matcher.state(tid) != "waiting_prefill":
        assert time.monotonic() < deadline, p.worker.push_write.matcher.state(tid)
        time.sleep(0.005)


def step_begins(p: Engine, step: int) -> StepMeta:
    """Engine step ``step`` begins and will compute p1's last chunk (start_load_kv)."""
    p.sched.track_push_prefill("p1", PROMPT, PUSH, 1)
    p.sched.after_alloc("p1", P_BLOCKS, 0, PUSH)
    p.sched.plan_push({"p1": (0, len(PROMPT))}, {}, set())
    meta = p.sched.take_meta()
    assert [r.req_id for r in meta.push_ready] == ["p1"]
    p.worker.submit(meta, step)
    return meta


def layer_landed(d: Engine, p: Engine, layer: int) -> bool:
    got, want = blocks_of(d.kv, D_BLOCKS)[layer], blocks_of(p.kv, P_BLOCKS)[layer]
    return torch.equal(got, want)


def wait_for(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def finish(p: Engine, ok: bool, step: int) -> None:
    keep, _ = p.sched.finished("p1", ok, P_BLOCKS, PUSH, PROMPT)
    assert keep
    p.worker.submit(p.sched.take_meta(), step)


def counters(e: Engine) -> dict[str, int]:
    return e.worker.stats.snapshot().counters


def landed(p: Engine) -> dict[str, int]:
    """P's counters once it counted the WRITE: P tells D first (PushJob.complete), so D may
    see its KV before P's transfer thread counts ``writes_done`` (a busy CI core did)."""
    assert wait_for(lambda: counters(p)["writes_done"] >= 1), counters(p)
    return counters(p)


# -- pure parts -------------------------------------------------------------------------


def test_layout_knows_each_layers_planes_and_descriptors_take_one_layer() -> None:
    kv = helpers_workers.caches(1)
    lay = CpuBackend().describe(kv, N, BS)
    assert lay.layers == ((0, 1), (2,))  # l0: K and V planes; l1: one plane
    loc, rem = descriptors(lay, lay, [2, 3, 4], [5, 6, 7], planes=[2])
    assert len(loc) == 1 and int(loc[0, 1]) == 3 * lay.planes[2].block_bytes
    assert int(rem[0, 0]) == lay.planes[2].base + 5 * lay.planes[2].stride
    all_loc, _ = descriptors(lay, lay, [2, 3, 4], [5, 6, 7])
    by_layer = np.concatenate([descriptors(lay, lay, [2, 3, 4], [5, 6, 7], planes=list(ps))[0]
                               for ps in lay.layers])
    assert np.array_equal(all_loc, by_layer)  # the layers together are the whole WRITE
    with pytest.raises(IndexError):
        descriptors(lay, lay, [2], [5], planes=[3])
    one = CpuBackend().describe({"all": kv["l1"]}, N, BS)
    assert one.layers == ()  # one tensor (cross-layer blocks): no layer-wise push


def test_fences_pass_per_step_and_are_forgotten() -> None:
    f = Fences()
    slow = FakeFence()
    f.add(LayerFence(3, 0, None))
    f.add(LayerFence(3, 1, slow))
    f.add(LayerFence(4, 0, None))
    assert f.passed(3, [0, 1, 2]) == [0]  # 1 not yet done, 2 never reported
    slow.passed.set()
    assert f.passed(3, [0, 1, 2]) == [0, 1]
    f.keep_only({4})
    assert f.passed(3, [0, 1]) == [] and f.passed(4, [0]) == [0] and len(f) == 1


def test_off_without_per_layer_planes_or_with_another_transport(engines) -> None:
    p = engines("P", seed=1, layerwise_push=True, nixl_backends=["UCX", "POSIX"])
    assert not p.worker.layerwise  # a Wrote sent on its own is ordered after UCX only
    assert not engines("P", seed=1).worker.layerwise  # off unless configured


# -- worker: real NIXL between two in-process workers ---------------------------------------


def test_layers_land_as_their_fences_pass_and_d_waits_for_the_gate(engines) -> None:
    p, d = layered_p(engines, 31), engines("D")
    d_register(d, p, "d1", "t1", D_BLOCKS)
    registered(p)
    meta = step_begins(p, 1)
    f0, f1 = FakeFence(), FakeFence()
    p.worker.layer_done(0, f0, 1)
    p.worker.layer_done(1, f1, 1)
    assert not wait_for(lambda: layer_landed(d, p, 0), 0.3)  # its kernels still running
    f0.passed.set()
    assert wait_for(lambda: layer_landed(d, p, 0))  # l0: both its planes
    assert not layer_landed(d, p, 1)  # l1's kernels still running
    f1.passed.set()
    assert wait_for(lambda: written(d, p, D_BLOCKS, P_BLOCKS))
    # Every layer landed during the forward, but D hears nothing until the forward is done
    # and the next step began without preempting the request.
    p.worker.forward_done(meta.push_ready, None, 1)
    assert "d1" not in d.collect(lambda r: "d1" in r.recvd, 0.4).recvd
    p.worker.submit(StepMeta(), 2)
    assert d.collect(lambda r: "d1" in r.recvd, 10).bad_blocks == set(), failures(p, d)
    c = landed(p)
    assert (c["layered_writes"], c["layers_posted_early"], c["writes_done"]) == (1, 2, 1)
    assert (c["layer_batches"], c["layer_fences"]) == (2, 2)
    # Written before P's scheduler finished the request: vLLM must not free it yet.
    assert "p1" not in settle(p, 0.3).sent
    finish(p, True, 3)
    assert p.collect(lambda r: "p1" in r.sent, 10).sent == {"p1"}
    assert p.worker.push_write.num_tracked == 0 and p.worker.push_write.num_unfinished == 0


def test_layers_without_a_hook_go_with_the_forwards_fence(engines) -> None:
    """A step replayed as one CUDA graph calls no save_kv_layer: the whole forward's fence
    (wait_for_save) releases every layer at once."""
    p, d = layered_p(engines, 32), engines("D")
    d_register(d, p, "d1", "t1", D_BLOCKS)
    registered(p)
    meta = step_begins(p, 1)
    fence = FakeFence()
    p.worker.forward_done(meta.push_ready, fence, 1)
    p.worker.submit(StepMeta(), 2)
    assert not wait_for(lambda: layer_landed(d, p, 0), 0.3)
    fence.passed.set()
    assert d.collect(lambda r: "d1" in r.recvd, 10).bad_blocks == set(), failures(p, d)
    assert written(d, p, D_BLOCKS, P_BLOCKS)
    c = counters(p)
    assert (c["layered_writes"], c["layers_posted_early"], c["layer_batches"]) == (1, 0, 1)


def test_registration_after_the_forward_is_a_whole_write(engines) -> None:
    p, d = layered_p(engines, 33), engines("D")
    meta = step_begins(p, 1)
    p.worker.layer_done(0, None, 1)
    p.worker.layer_done(1, None, 1)
    p.worker.forward_done(meta.push_ready, None, 1)
    p.worker.submit(StepMeta(), 2)  # the gate opens with nobody to write to yet
    assert wait_for(lambda: p.worker.push_write.num_tracked == 1)  # gate open, prefill held
    d_register(d, p, "d1", "t1", D_BLOCKS)
    assert d.collect(lambda r: "d1" in r.recvd, 10).bad_blocks == set(), failures(p, d)
    assert written(d, p, D_BLOCKS, P_BLOCKS)
    c = landed(p)
    assert (c["layered_writes"], c["writes_done"]) == (0, 1)
    finish(p, True, 3)
    assert p.collect(lambda r: "p1" in r.sent, 10).sent == {"p1"}
    assert p.worker.push_write.num_tracked == 0


def test_preemption_after_layers_landed_rejects_d_and_frees_once(engines) -> None:
    p, d = layered_p(engines, 34), engines("D")
    d_register(d, p, "d1", "t1", D_BLOCKS)
    registered(p)
    meta = step_begins(p, 1)
    p.worker.layer_done(0, None, 1)
    p.worker.layer_done(1, None, 1)
    assert wait_for(lambda: written(d, p, D_BLOCKS, P_BLOCKS))
    p.worker.forward_done(meta.push_ready, None, 1)
    p.sched.plan_push({}, {}, {"p1"})  # step 2's schedule preempted p1: vLLM freed its blocks
    p.worker.submit(p.sched.take_meta(), 2)
    got = d.collect(lambda r: "d1" in r.recvd, 10)  # P rejects: D recomputes, never reads
    assert set(D_BLOCKS) <= got.bad_blocks
    assert "p1" not in settle(p, 0.3).sent  # vLLM freed them itself; the request lives on
    c = counters(p)
    assert (c["writes_done"], c["writes_failed"], c["layered_writes"]) == (0, 1, 0)
    # Resumed and finished later: P frees its (new) blocks once; nothing more is written.
    finish(p, True, 3)
    assert p.collect(lambda r: "p1" in r.sent, 10).sent == {"p1"}
    assert counters(p)["writes_done"] == 0
    assert p.worker.push_write.num_tracked == 0 and p.worker.push_write.num_unfinished == 0


def test_abort_during_the_forward_still_completes_the_write(engines) -> None:
    """The client went away while the last chunk ran: blocks under a layer WRITE are freed
    only once it ended (the matcher's rule), and D, which did register, gets its KV."""
    p, d = layered_p(engines, 35), engines("D")
    d_register(d, p, "d1", "t1", D_BLOCKS)
    registered(p)
    meta = step_begins(p, 1)
    p.worker.layer_done(0, None, 1)
    p.worker.forward_done(meta.push_ready, None, 1)
    keep, _ = p.sched.finished("p1", False, P_BLOCKS, PUSH, PROMPT)
    assert keep
    p.worker.submit(p.sched.take_meta(), 2)  # push_abort_p, and the next step began
    assert d.collect(lambda r: "d1" in r.recvd, 10).bad_blocks == set(), failures(p, d)
    assert written(d, p, D_BLOCKS, P_BLOCKS)
    assert p.collect(lambda r: "p1" in r.sent, 10).sent == {"p1"}
    assert p.worker.push_write.num_tracked == 0


def test_failed_layer_post_rejects_d_and_frees_when_finished(engines, monkeypatch) -> None:
    p, d = layered_p(engines, 36), engines("D")
    d_register(d, p, "d1", "t1", D_BLOCKS)
    registered(p)
    real = p.worker.transport.start
    calls = []

    def second_fails(*a, **kw):
        calls.append(kw.get("planes"))
        if len(calls) == 2:
            raise RuntimeError("injected post failure")
        return real(*a, **kw)

    monkeypatch.setattr(p.worker.transport, "start", second_fails)
    meta = step_begins(p, 1)
    p.worker.layer_done(0, None, 1)
    assert wait_for(lambda: layer_landed(d, p, 0))
    p.worker.layer_done(1, None, 1)
    assert set(D_BLOCKS) <= d.collect(lambda r: "d1" in r.recvd, 10).bad_blocks
    assert calls == [[0, 1], [2]]
    p.worker.forward_done(meta.push_ready, None, 1)
    finish(p, True, 2)  # P's scheduler ends the request: its blocks are freed once
    assert p.collect(lambda r: "p1" in r.sent, 10).sent == {"p1"}
    assert counters(p)["writes_failed"] == 1
    assert p.worker.push_write.num_tracked == 0


def test_a_gate_that_never_opens_times_out(engines) -> None:
    """No forward fence ever arrives (the engine died mid-step, say): the WRITE fails at
    recv_timeout_s, D is rejected, nothing stays tracked."""
    p, d = layered_p(engines, 37, recv_timeout_s=1.0), engines("D")
    d_register(d, p, "d1", "t1", D_BLOCKS)
    registered(p)
    step_begins(p, 1)
    p.worker.layer_done(0, None, 1)
    p.worker.layer_done(1, None, 1)
    assert set(D_BLOCKS) <= d.collect(lambda r: "d1" in r.recvd, 10).bad_blocks
    assert counters(p)["writes_failed"] == 1
    finish(p, True, 2)
    assert p.collect(lambda r: "p1" in r.sent, 10).sent == {"p1"}
    assert p.worker.push_write.num_tracked == 0


# -- peers of different TP sizes: every P rank writes its heads, layer by layer -------------

TP_HEADS, HD = 4, 8


def _nhd(g: torch.Tensor, hs: list[int]) -> torch.Tensor:
    """(N, H, BS, 2*HD) global KV -> one rank's NHD cache (2, N, BS, heads, HD)."""
    return torch.stack(g[:, hs].permute(0, 2, 1, 3).split(HD, dim=3)).contiguous()


class TpEngine:
    """One engine of ``tp`` ranks, each a TransferWorker over two NHD layers."""

    def __init__(self, role: str, tp: int, gs: list[torch.Tensor] | None, **cfg) -> None:
        from helpers_http import free_port

        from kvferry.connectors.config import ConnectorConfig
        from kvferry.connectors.protocol.tp_map import heads_of
        from kvferry.connectors.transfer.worker import TransferWorker

        self.engine_id, self.port, self.tp = f"{role}-{uuid.uuid4().hex[:8]}", free_port(), tp
        self.cfg = ConnectorConfig(side_channel_port=self.port, handshake_timeout_s=15.0,
                                   recv_timeout_s=10.0, **cfg)
        base = gs or [torch.zeros(N, TP_HEADS, BS, 2 * HD) for _ in range(2)]
        self.kv = [{f"l{i}": _nhd(g, list(heads_of(r, tp, TP_HEADS))) for i, g in enumerate(base)}
                   for r in range(tp)]
        self.workers = [TransferWorker(self.cfg, self.engine_id, r,
                                       CpuBackend().describe(self.kv[r], N, BS, 3),
                                       tp_size=tp, num_heads=TP_HEADS) for r in range(tp)]
        self.sched = TransferScheduler(self.engine_id, "127.0.0.1", self.port, BS, tp,
                                       num_kv_heads=TP_HEADS, early_push=True)
        self.acc = [Results() for _ in range(tp)]

    def submit(self, meta: StepMeta, step: int = 0) -> None:
        for w in self.workers:  # vLLM hands every rank the same metadata
            w.submit(meta, step)

    def wait(self, req: str, what: str, timeout: float = 15.0) -> list[Results]:
        return wait_ranks(self.workers, self.acc, req, what, timeout)

    def close(self) -> None:
        for w in self.workers:
            w.close()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_layers_go_to_every_d_rank_taking_our_heads(monkeypatch, p_tp: int, d_tp: int) -> None:
    from kvferry.connectors.protocol.params import SECRET_ENV
    from kvferry.connectors.protocol.tp_map import heads_of

    monkeypatch.setenv(SECRET_ENV, "layer-tp-secret")
    gen = torch.Generator().manual_seed(7)
    gs = [torch.randn(N, TP_HEADS, BS, 2 * HD, generator=gen) for _ in range(2)]
    p = TpEngine("P", p_tp, gs, layerwise_push=True)
    d = TpEngine("D", d_tp, None)
    try:
        params = {"do_remote_prefill": True, "push": True, "transfer_id": "t1",
                  "remote_host": "127.0.0.1", "remote_port": p.port}
        count, is_async = d.sched.matched_tokens("d1", PROMPT, params, 0)
        assert is_async
        d.sched.after_alloc("d1", D_BLOCKS, count)
        d.submit(d.sched.take_meta())
        assert wait_for(lambda: all(w.stats.snapshot()["registrations"] >= 1 for w in p.workers))
        p.sched.track_push_prefill("p1", PROMPT, PUSH, 1)
        p.sched.after_alloc("p1", P_BLOCKS, 0, PUSH)
        p.sched.plan_push({"p1": (0, len(PROMPT))}, {}, set())
        meta = p.sched.take_meta()
        p.submit(meta, 1)
        for w in p.workers:  # each rank's own forward reports its layers
            w.layer_done(0, None, 1)
            w.layer_done(1, None, 1)
        assert not any("d1" in a.recvd for a in d.wait("d1", "recvd", 0.3))  # gate closed
        for w in p.workers:
            w.forward_done(meta.push_ready, None, 1)
        p.submit(StepMeta(), 2)
        got = d.wait("d1", "recvd")
        assert all(a.recvd == {"d1"} and not a.bad_blocks for a in got), got
        for i, g in enumerate(gs):
            want = torch.zeros_like(g)
            want[D_BLOCKS] = g[P_BLOCKS]
            for r in range(d_tp):
                assert torch.equal(d.kv[r][f"l{i}"], _nhd(want, list(heads_of(r, d_tp, TP_HEADS))))
        assert all(w.stats.snapshot()["layered_writes"] >= 1 for w in p.workers)
        keep, _ = p.sched.finished("p1", True, P_BLOCKS, PUSH, PROMPT)
        assert keep
        p.submit(p.sched.take_meta(), 3)
        assert all(a.sent == {"p1"} for a in p.wait("p1", "sent")), p.acc
        assert all(w.push_write.num_tracked == 0 for w in p.workers)
    finally:
        p.close()
        d.close()
