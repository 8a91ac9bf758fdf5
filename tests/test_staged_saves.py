"""Host staging, scheduler side and glue: which blocks P stages out each step, and when
an engine that may stage through host DRAM stops granting decode leases.

Pure state plus KvferryConnector with stub vLLM objects: no engines, no NIXL transfers.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers_http import free_port
from vllm.v1.core.sched.output import CachedRequestData

from kvferry.connectors import compat
from kvferry.connectors.compat import KVConnectorRole
from kvferry.connectors.connector import KvferryConnector, KvferryMeta
from kvferry.connectors.memory.backends import CpuBackend
from kvferry.connectors.protocol.params import SECRET_ENV
from kvferry.connectors.protocol.step import StepMeta
from kvferry.connectors.scheduling.scheduler import TransferScheduler
from kvferry.connectors.scheduling.staged_saves import SaveTracker
from kvferry.neuron.backend import ENV_STAGING

BS = 16
P_PARAMS = {"do_remote_decode": True}


@pytest.fixture(autouse=True)
def _secret(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "staged-saves-secret")
    monkeypatch.delenv(ENV_STAGING, raising=False)



def sched(stage: bool = True) -> TransferScheduler:
    return TransferScheduler("P", "127.0.0.1", 5600, BS, stage_saves=stage)


# -- SaveTracker ------------------------------------------------------------------------------
def test_whole_prompt_in_one_step_stages_every_block_once():
    t = SaveTracker(BS)
    t.allocated("r", [7, 3, 9, 4])
    assert t.step({"r": (0, 50)}) == [7, 3, 9, 4]  # 50 tokens -> 4 blocks
    assert t.step({"r": (50, 1)}) == [4]  # a decode step (max_tokens > 1) rewrites the tail


def test_prefix_hit_blocks_are_staged_too():
    """Hit blocks are on the device, but their mirror may hold an earlier owner's bytes."""
    t = SaveTracker(BS)
    t.allocated("r", [1, 2, 3])
    assert t.step({"r": (32, 8)}) == [1, 2, 3]


def test_chunked_prefill_stages_each_block_about_once():
    t = SaveTracker(BS)
    t.allocated("r", [10, 11])  # first chunk: 24 tokens
    assert t.step({"r": (0, 24)}) == [10, 11]
    t.grew({"r": ([12, 13], False)})
    assert t.step({"r": (24, 24)}) == [11, 12]  # the half-full block again, then the new one
    assert t.step({"r": (48, 10)}) == [13]


def test_resumed_request_starts_over_with_its_new_blocks():
    t = SaveTracker(BS)
    t.allocated("r", [1, 2])
    t.step({"r": (0, 32)})
    t.grew({"r": ([5, 6, 7], True)})  # preempted, resumed with other blocks
    assert t.step({"r": (0, 40)}) == [5, 6, 7]
    t.allocated("r", [8])  # or vLLM re-allocated it through update_state_after_alloc
    assert t.step({"r": (0, 3)}) == [8]


def test_untracked_unscheduled_and_dropped_requests_stage_nothing():
    t = SaveTracker(BS)
    t.allocated("r", [1])
    t.grew({"other": ([2], False)})
    assert t.step({"other": (0, 5), "r": (0, 0)}) == []
    t.drop(["r"])
    assert t.step({"r": (0, 5)}) == []


# -- TransferScheduler -------------------------------------------------------------------------
def test_scheduler_tracks_pull_p_requests_only():
    s = sched()
    s.after_alloc("pull", [1, 2], 0, P_PARAMS)
    s.after_alloc("push", [3, 4], 0, {"do_remote_decode": True, "push": True})
    s.after_alloc("plain", [5], 0, None)
    s.after_alloc("d", [6], 0, {"do_remote_prefill": True})
    s.plan_saves({r: (0, 20) for r in ("pull", "push", "plain", "d")})
    assert s.take_meta().save == [1, 2]
    assert s.take_meta().save == []  # handed over once


def test_scheduler_drops_the_record_when_the_request_finishes():
    s = sched()
    s.after_alloc("r", [1, 2], 0, P_PARAMS)
    s.plan_saves({"r": (0, 20)})
    assert s.take_meta().save == [1, 2]
    keep, offer = s.finished("r", True, [1, 2], P_PARAMS, list(range(20)))
    assert keep and offer["remote_block_ids"] == [1, 2]
    s.plan_saves({"r": (20, 1)})
    assert s.take_meta().save == []


def test_without_host_staging_nothing_is_tracked():
    s = sched(stage=False)
    assert s.saves is None
    s.after_alloc("r", [1, 2], 0, P_PARAMS)
    s.plan_saves({"r": (0, 20)})
    assert s.take_meta().save == []
    assert StepMeta().save == [] and not StepMeta(save=[1]).has_push()


# -- compat: what vLLM's SchedulerOutput says ---------------------------------------------------
def scheduler_output(cached, new=(), scheduled=None):
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached,
                           num_scheduled_tokens=scheduled or {})


def test_compat_reads_vllm_032_scheduler_output():
    cached = CachedRequestData(
        req_ids=["run", "res", "idle"], resumed_req_ids={"res"}, new_token_ids=[[], [], []],
        all_token_ids={}, new_block_ids=[([4],), ([7, 8],), None],
        num_computed_tokens=[16, 0, 5], num_output_tokens=[0, 0, 1])
    out = scheduler_output(cached, [SimpleNamespace(req_id="new", num_computed_tokens=32)],
                           {"run": 16, "res": 20, "new": 4})
    assert compat.step_progress(out) == {"run": (16, 16), "res": (0, 20), "new": (32, 4)}
    assert compat.grown_blocks(out) == {"run": ([4], False), "res": ([7, 8], True)}


# -- the connector glue ---------------------------------------------------------------------------
def vllm_config(extra: dict) -> SimpleNamespace:
    ktc = SimpleNamespace(kv_connector_extra_config=extra, engine_id="eng")
    return SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=BS,
                                                                               num_gpu_blocks=64),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1))


def connector(extra: dict) -> KvferryConnector:
    port = free_port()
    extra = {"side_channel_port": port, "lease_control_port": free_port(), **extra}
    return KvferryConnector(vllm_config(extra), KVConnectorRole.SCHEDULER,
                            SimpleNamespace(num_blocks=64))


@pytest.mark.parametrize("extra, env, host", [
    ({}, None, False),  # cpu
    ({"hardware_backend": "cuda"}, None, False),
    ({"hardware_backend": "neuron", "neuron_staging": "device"}, None, False),
    ({"hardware_backend": "neuron", "neuron_staging": "host"}, None, True),
    ({"hardware_backend": "neuron"}, None, True),  # auto: decided in the worker, by probing
    ({"hardware_backend": "neuron"}, "device", False),  # like NeuronBackend: env when unset
    ({"hardware_backend": "neuron", "neuron_staging": "host"}, "device", True),
])
def test_host_staging_engines_track_saves_and_grant_no_leases(monkeypatch, caplog, extra, env, host):
    if env:
        monkeypatch.setenv(ENV_STAGING, env)
    c = connector(extra)
    try:
        assert (c._sched.saves is not None) is host
        assert (c._sched.leases is None) is host
        assert ("keeps no decode leases" in caplog.text) is host
        if host:  # a finished D turn asking for a lease just frees its blocks
            assert c._sched.finished("d", True, [1, 2], {"lease": {"lease_id": "L"}},
                                     list(range(40)), tokens=list(range(40)),
                                     num_computed=40) == (False, None)
    finally:
        c.shutdown()


def test_glue_puts_p_blocks_in_step_meta_and_wait_for_save_stages_them():
    c = connector({"hardware_backend": "neuron", "neuron_staging": "host"})
    req = SimpleNamespace(request_id="p", kv_transfer_params=dict(P_PARAMS))
    blocks = SimpleNamespace(get_block_ids=lambda: ([3, 9],))
    c.update_state_after_alloc(req, blocks, 0)
    meta = c.build_connector_meta(scheduler_output(
        CachedRequestData.make_empty(), [SimpleNamespace(req_id="p", num_computed_tokens=0)],
        {"p": 20}))
    assert isinstance(meta, KvferryMeta) and meta.step.save == [3, 9]

    saved: list[list[int]] = []
    steps: list[int] = []
    c._worker = worker_stub(saved.append, steps)
    c.bind_connector_metadata(meta)
    c.wait_for_save()
    c.bind_connector_metadata(KvferryMeta(StepMeta()))
    c.wait_for_save()  # nothing to stage: no call
    assert saved == [[3, 9]]
    assert steps == [1, 2]  # each step's metadata reached the worker when it was bound
    c.shutdown()


def worker_stub(save, steps: list[int]) -> SimpleNamespace:
    """The TransferWorker surface the glue uses around a forward (no NIXL)."""
    return SimpleNamespace(save=save, close=lambda: None, layerwise=False,
                           submit=lambda meta, step: steps.append(step))


def test_cpu_glue_is_unchanged():
    c = connector({})
    c.update_state_after_alloc(SimpleNamespace(request_id="p", kv_transfer_params=dict(P_PARAMS)),
                               SimpleNamespace(get_block_ids=lambda: ([3],)), 0)
    meta = c.build_connector_meta(None)  # scheduler_output is not even looked at
    assert meta.step.save == [] and c._sched.leases is not None
    c._worker = worker_stub(lambda ids: pytest.fail("no staging on cpu"), [])
    c.bind_connector_metadata(meta)
    c.wait_for_save()
    assert getattr(CpuBackend(), "staging", None) is None
    c.shutdown()


@pytest.mark.parametrize("value, warned", [("", True), ("s3cr3t", False)])
def test_engine_without_the_secret_says_so(monkeypatch, caplog, value, warned):
    """Without KVFERRY_SECRET D can verify no offer and no lease request: every request
    would silently recompute, so the engine says it once at start."""
    monkeypatch.setenv("KVFERRY_SECRET", value)
    c = connector({})
    try:
        assert ("KVFERRY_SECRET is not set" in caplog.text) is warned
    finally:
        c.shutdown()
