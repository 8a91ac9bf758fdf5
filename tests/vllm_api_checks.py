"""kvferry against one vLLM version's real Python code (run by test_vllm_versions.py).

That test starts pytest on this file once per supported version, with the version's
sources (fetched by .ci/setup) first on PYTHONPATH, so every vLLM object here is that
version's own: its Scheduler, configs, requests, outputs, connector base class, factory,
plugin loader, attention backends and KV allocation code. No engine starts and no
compiled vLLM extension is needed: the scheduler runs in this process, and the tests
stand in for the model runner with the outputs it would return.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import vllm
from helpers_http import free_port
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import base
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvferry.connectors import compat
from kvferry.connectors.connector import KvferryConnector
from kvferry.connectors.memory.backends import CpuBackend
from kvferry.connectors.protocol.params import SECRET_ENV
from kvferry.connectors.transfer import layout
from kvferry.scripts.modelgen import SHAPES, write_model

VERSION = tuple(int(x) for x in vllm.__version__.split(".")[:2])
BS = 16  # tokens per block
NUM_BLOCKS = 64
PROMPT = list(range(1, 41))  # 40 tokens: 3 blocks
ABSTRACT = {"get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
            "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save"}

init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "vllm-api-checks")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("model") / "tiny", "tiny")


def vllm_config(model: Path, extra: dict[str, Any] | None = None, engine_id: str = "E",
                max_batched: int = 512) -> VllmConfig:
    """A real VllmConfig for kvferry with fresh side-channel and control ports."""
    ktc = KVTransferConfig(
        kv_connector="KvferryConnector", kv_role="kv_both", engine_id=engine_id,
        kv_connector_module_path="kvferry.connectors.connector", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"side_channel_port": free_port(),
                                   "lease_control_port": free_port(), **(extra or {})})
    return VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        model_config=ModelConfig(model=str(model), dtype="float32", seed=0, max_model_len=512),
        cache_config=CacheConfig(block_size=BS),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched,
                                         max_model_len=512, is_encoder_decoder=False),
        kv_transfer_config=ktc)


def kv_cache_config(num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)])


def scheduler(vc: VllmConfig, num_blocks: int = NUM_BLOCKS) -> Scheduler:
    """vLLM's own scheduler; it creates the scheduler-side KvferryConnector itself."""
    vc.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(vllm_config=vc, kv_cache_config=kv_cache_config(num_blocks),
                     structured_output_manager=StructuredOutputManager(vc), block_size=BS,
                     log_stats=False)


@pytest.fixture
def make(tiny: Path) -> Iterator[Callable[..., Scheduler]]:
    made: list[Scheduler] = []

    def _make(engine_id: str, extra: dict[str, Any] | None = None, num_blocks: int = NUM_BLOCKS,
              **kw: Any) -> Scheduler:
        made.append(scheduler(vllm_config(tiny, extra, engine_id, **kw), num_blocks))
        return made[-1]

    yield _make
    for s in made:
        s.connector.shutdown()


def request(req_id: str, prompt: list[int], max_tokens: int, params: dict | None) -> Request:
    sp = SamplingParams(max_tokens=max_tokens,
                        extra_args={"kv_transfer_params": params} if params else None)
    return Request(request_id=req_id, prompt_token_ids=prompt, sampling_params=sp,
                   pooling_params=None, block_hasher=HASHER)


def step(s: Scheduler, kv_out: KVConnectorOutput | None = None) -> tuple[SchedulerOutput, list]:
    """One engine step: schedule, then what the model runner would return (a token for
    every request whose prompt is complete, the workers' transfer results)."""
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    toks = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else []
            for r in ids]
    out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=toks, kv_connector_output=kv_out)
    engine_outputs = s.update_from_output(so, out)
    return so, [o for eo in engine_outputs.values() for o in eo.outputs]


def blocks_of(s: Scheduler, req_id: str) -> list[int]:
    return list(s.kv_cache_manager.get_block_ids(req_id)[0])


def free_blocks(s: Scheduler) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


# -- the version and the class -----------------------------------------------------------------
def test_runs_the_expected_vllm():
    assert vllm.__version__ == os.environ["KVFERRY_EXPECT_VLLM"]
    if src := os.environ.get("KVFERRY_VLLM_SRC"):  # that version's sources, not the venv's
        assert Path(vllm.__file__).resolve().is_relative_to(Path(src).resolve())


def test_connector_implements_this_versions_base_class():
    assert set(base.KVConnectorBase_V1.__abstractmethods__) == ABSTRACT
    assert issubclass(KvferryConnector, base.KVConnectorBase_V1)
    assert not KvferryConnector.__abstractmethods__


def _kind(obj: Any) -> str:
    return type(obj).__name__ if isinstance(obj, property | classmethod | staticmethod) else "method"


def test_every_override_matches_the_base_signature():
    """vLLM calls these by position and keyword: ours must take whatever it passes."""
    checked = []
    for name, ours in vars(KvferryConnector).items():
        theirs = inspect.getattr_static(base.KVConnectorBase_V1, name, None)
        if theirs is None or (name.startswith("_") and name != "__init__"):
            continue
        assert _kind(ours) == _kind(theirs), name
        if isinstance(ours, property):
            checked.append(name)
            continue
        po = list(inspect.signature(getattr(KvferryConnector, name)).parameters.values())
        pb = list(inspect.signature(getattr(base.KVConnectorBase_V1, name)).parameters.values())
        var = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in po)
        for i, p in enumerate(pb):
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                assert any(q.kind == p.kind for q in po), (name, p)
                continue
            assert var or (i < len(po) and po[i].name == p.name), (name, p.name)
        assert all(q.default is not q.empty or q.kind in (q.VAR_POSITIONAL, q.VAR_KEYWORD)
                   for q in po[len(pb):]), name
        checked.append(name)
    assert {"request_finished", "get_finished", "update_connector_output",
            "get_block_ids_with_load_errors", "register_kv_caches", "shutdown"} <= set(checked)
    # version-specific hooks kvferry implements exist exactly where compat says
    assert ("prefer_cross_layer_blocks" in checked) is compat.CROSS_LAYER_HOOKS is (VERSION < (0, 32))
    assert ("supports_sleep_mode" in checked) is compat.SLEEP_MODE_HOOK is (VERSION >= (0, 33))
    assert ("has_pending_block_frees" in checked) is (VERSION >= (0, 32))
    assert compat.LOGICAL_BHNC is (VERSION >= (0, 32))


# -- plugin and factory ------------------------------------------------------------------------
def test_plugin_entry_point_registers_with_this_versions_factory(monkeypatch):
    from importlib.metadata import entry_points

    import vllm.plugins

    from kvferry.connectors.plugin import register

    assert vllm.plugins.DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"  # pyproject's group
    assert any(e.name == "kvferry" for e in entry_points(group="vllm.general_plugins"))
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.delitem(KVConnectorFactory._registry, "KvferryConnector", raising=False)
    vllm.plugins.load_general_plugins()  # what every vLLM process does at start
    assert KVConnectorFactory.get_connector_class_by_name("KvferryConnector") is KvferryConnector
    register()  # loaded again in the same process: no error
    ktc = KVTransferConfig(kv_connector="KvferryConnector", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(ktc) is KvferryConnector


# -- the scheduler side, driven by this version's own Scheduler ---------------------------------
def _prefill_on_p(P: Scheduler) -> dict:
    """P computes PROMPT for D (max_tokens 1) and answers with its signed offer."""
    P.add_request(request("p1", PROMPT, 1, {"do_remote_decode": True}))
    so, outs = step(P)
    assert dict(so.num_scheduled_tokens) == {"p1": len(PROMPT)}
    (out,) = outs
    assert out.finish_reason is not None and out.kv_transfer_params is not None
    offer = out.kv_transfer_params
    assert offer["remote_block_ids"][:3] == blocks_of(P, "p1")[:3]  # P still holds them
    assert offer["remote_num_tokens"] == len(PROMPT) and offer["remote_engine_id"] == "P"
    return offer


def test_pull_handoff_through_the_real_scheduler(make):
    P, D = make("P"), make("D")
    offer = _prefill_on_p(P)
    held = free_blocks(P)
    assert held == NUM_BLOCKS - 1 - 3  # the finished prefill's 3 blocks wait for D's READ

    D.add_request(request("d1", PROMPT, 3, dict(offer, do_remote_prefill=True)))
    so, _ = step(D)
    assert dict(so.num_scheduled_tokens) == {}
    assert D.requests["d1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (task,) = so.kv_connector_metadata.step.recv
    assert task.local_block_ids == blocks_of(D, "d1")[:3]
    assert task.remote_block_ids == offer["remote_block_ids"][:3]

    step(D, KVConnectorOutput(finished_recving={"d1"}))  # D's transfer thread: READ done
    so, _ = step(D)
    assert dict(so.num_scheduled_tokens) == {"d1": 1}  # D computes the last token only
    assert D.requests["d1"].status == RequestStatus.RUNNING

    step(P)  # the step after the prefill finished; then, with only p1 waiting for D:
    assert P.has_requests() is (VERSION >= (0, 24))  # 0.21's engine stops stepping here
    so, _ = step(P, KVConnectorOutput(finished_sending={"p1"}))  # P's thread: D has read
    assert free_blocks(P) == NUM_BLOCKS - 1 and "p1" not in P.requests
    assert not P.connector._sched.waiting_send


def test_failed_read_recomputes_the_prompt(make):
    P, D = make("P"), make("D")
    offer = _prefill_on_p(P)
    D.add_request(request("d1", PROMPT, 3, dict(offer, do_remote_prefill=True)))
    so, _ = step(D)
    (task,) = so.kv_connector_metadata.step.recv
    # the READ failed: the worker reports the request done and its first block invalid
    step(D, KVConnectorOutput(finished_recving={"d1"}, invalid_block_ids={task.local_block_ids[0]}))
    so, _ = step(D)
    assert dict(so.num_scheduled_tokens) == {"d1": len(PROMPT)}  # recomputed from block 0


def test_early_push_follows_chunked_prefill_blocks(make):
    """P's early push learns the blocks of a prompt prefilled in chunks from what the
    scheduler reports each step (compat.step_progress / grown_blocks on this version's
    SchedulerOutput): the WRITE handed over with the last chunk names them all."""
    P = make("P", max_batched=32)
    prompt = list(range(1, 101))  # 100 tokens: 7 blocks, scheduled 32 at a time
    P.add_request(request("p1", prompt, 1, {"do_remote_decode": True, "push": True,
                                             "transfer_id": "t1"}))
    ready, steps = [], 0
    while not ready:
        so, outs = step(P)
        steps += 1
        ready = so.kv_connector_metadata.step.push_ready
        assert steps < 6
    assert steps == 4 and sum(so.num_scheduled_tokens.values()) == 100 - 96
    (push,) = ready
    assert push.transfer_id == "t1" and push.num_tokens == 100
    assert push.block_ids == blocks_of(P, "p1")[:7]
    assert outs and outs[0].kv_transfer_params == {"transfer_id": "t1", "push": True}


def test_push_decode_registers_its_blocks(make):
    D = make("D")
    D.add_request(request("d1", PROMPT, 3, {"do_remote_prefill": True, "push": True,
                                             "transfer_id": "t1", "remote_host": "127.0.0.1",
                                             "remote_port": 5600}))
    so, _ = step(D)
    (reg,) = so.kv_connector_metadata.step.register
    assert reg.transfer_id == "t1" and reg.block_ids == blocks_of(D, "d1")[:3]
    assert reg.num_tokens == len(PROMPT) and reg.first_token == 0
    step(D, KVConnectorOutput(finished_recving={"d1"}))  # P's WRITE landed
    so, _ = step(D)
    assert dict(so.num_scheduled_tokens) == {"d1": 1}


LEASE_TIMING = {"reuse_read_timeout_s": 0.02, "lease_margin_s": 1.0, "lease_free_grace_s": 0.05}


def test_leases_yield_to_running_requests_where_vllm_asks(make):
    """D keeps a finished turn's blocks under a lease. When a running request needs a
    block and none is free, 0.32+ asks the connector before preempting
    (has_pending_block_frees) and the lease yields; older versions never ask: they
    preempt, and the lease holds its blocks until its TTL or the router's release."""
    D = make("D", LEASE_TIMING, num_blocks=8)  # 7 usable blocks
    D.add_request(request("d1", PROMPT, 2, {"lease": {"lease_id": "L1"}}))
    outs: list = []
    while not outs or outs[-1].finish_reason is None:
        _, outs = step(D)
    lease = outs[-1].kv_transfer_params["lease"]
    assert lease["lease_id"] == "L1" and lease["block_ids"] == blocks_of(D, "d1")[:2]
    assert "d1" in D.requests and free_blocks(D) == 7 - 3  # kept for the next turn's P

    D.add_request(request("d2", list(range(100, 164)), 3, None))  # 64 tokens: the 4 free
    so, _ = step(D)
    assert dict(so.num_scheduled_tokens) == {"d2": 64} and free_blocks(D) == 0
    so, _ = step(D)  # d2's next token needs a fifth block
    assert dict(so.num_scheduled_tokens) == {}
    held = D.connector._sched.leases.table  # "in": still held (a release frees at once)
    if VERSION < (0, 32):
        assert D.requests["d2"].status == RequestStatus.PREEMPTED
        assert "L1" in held  # nobody asked kvferry
        return
    assert D.requests["d2"].status == RequestStatus.RUNNING  # not preempted:
    assert "L1" not in held  # vLLM asked; kvferry released the least recently used lease
    time.sleep(LEASE_TIMING["lease_free_grace_s"] * 3)  # a free waits out READs in flight
    so, _ = step(D)
    assert so.kv_connector_metadata.step.free == ["d1"]  # the worker frees, then reports it
    step(D, KVConnectorOutput(finished_sending={"d1"}))
    so, _ = step(D)
    assert dict(so.num_scheduled_tokens) == {"d2": 1}


def test_worker_side_glue_on_this_base_class(tiny):
    """The base-class state kvferry's worker side reads, and the calls vLLM's model runner
    makes around a step (0.32+: get_transfer_results wraps get_finished)."""
    from kvferry.connectors.connector import KvferryMeta
    from kvferry.connectors.scheduling.scheduler import StepMeta

    vc, kvc = vllm_config(tiny), kv_cache_config()
    c = KvferryConnector(vc, base.KVConnectorRole.WORKER, kvc)
    assert c._vllm_config is vc and c._kv_cache_config is kvc
    assert c._kv_transfer_config is vc.kv_transfer_config and c.role == base.KVConnectorRole.WORKER
    meta = KvferryMeta(StepMeta(idle=True))
    c.bind_connector_metadata(meta)
    assert c._connector_metadata is meta
    c.start_load_kv(SimpleNamespace())  # no KV registered yet: nothing to submit
    c.wait_for_save()
    assert c.get_finished(set()) == (None, None)
    if hasattr(base.KVConnectorBase_V1, "get_transfer_results"):
        res = c.get_transfer_results(set())
        assert (res.finished_sending, res.finished_recving) == (set(), set())
    assert c.get_block_ids_with_load_errors() == set()
    c.clear_connector_metadata()
    assert c._connector_metadata is None
    c.shutdown()


# -- compat on this version's objects ----------------------------------------------------------
def test_compat_reads_real_scheduler_objects(tiny):
    blocks = KVCacheBlocks(blocks=([KVCacheBlock(block_id=b) for b in (4, 9, 2)],))
    assert compat.request_blocks(blocks) == [4, 9, 2]
    assert compat.first_group(blocks.get_block_ids()) == [4, 9, 2]
    cached = CachedRequestData.make_empty()
    cached.req_ids, cached.resumed_req_ids = ["run", "res", "idle"], {"res"}
    cached.new_block_ids = [([5],), ([7, 8],), None]
    cached.num_computed_tokens = [16, 0, 5]
    new = NewRequestData(req_id="new", prompt_token_ids=PROMPT, mm_features=[],
                         sampling_params=SamplingParams(max_tokens=3), pooling_params=None,
                         block_ids=([1, 2, 3],), num_computed_tokens=32, lora_request=None)
    so = SchedulerOutput.make_empty()
    so.scheduled_new_reqs, so.scheduled_cached_reqs = [new], cached
    so.num_scheduled_tokens = {"run": 16, "res": 20, "new": 8}
    so.total_num_scheduled_tokens = 44
    so.preempted_req_ids = {"gone"}
    assert compat.step_progress(so) == {"run": (16, 16), "res": (0, 20), "new": (32, 8)}
    assert compat.grown_blocks(so) == {"run": ([5], False), "res": ([7, 8], True)}
    assert compat.preempted(so) == {"gone"} and compat.scheduled_tokens(so) == 44

    r = request("r", PROMPT, 5, {"do_remote_decode": True})
    r.append_output_token_ids(11)
    assert compat.all_tokens(r) == [*PROMPT, 11] and compat.max_tokens(r) == 5
    assert r.kv_transfer_params == {"do_remote_decode": True}
    assert {s.name for s in compat.FINISHED_OK} == {"FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"}

    vc = vllm_config(tiny)
    assert compat.num_blocks(vc, kv_cache_config()) == NUM_BLOCKS
    assert compat.total_kv_heads(vc) == SHAPES["tiny"].num_key_value_heads == json.loads(
        (tiny / "config.json").read_text())["num_key_value_heads"]


def test_kv_heads_dim_of_this_versions_attention_backends():
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    # what each version's FlashAttention tensor is (read from its get_kv_cache_shape)
    want = {(0, 21): 3, (0, 24): 3, (0, 26): 1}.get(VERSION, 1)  # 0.32+: logical [B, H, N, C]
    got = compat.kv_heads_dim(None, {}, FlashAttentionBackend) if VERSION < (0, 32) else \
        compat.kv_heads_dim(None, {"l": None})
    assert got == want
    if VERSION < (0, 32):
        shape = FlashAttentionBackend.get_kv_cache_shape(num_blocks=10, block_size=16,
                                                         num_kv_heads=3, head_size=8)
        assert shape[want] == 3


# -- sleep mode ---------------------------------------------------------------------------------
def test_sleep_mode_is_refused(tiny):
    vc = vllm_config(tiny)
    if compat.SLEEP_MODE_HOOK:  # 0.33: vLLM asks the connector class and refuses the config
        ktc = vc.kv_transfer_config
        assert base.KVConnectorBase_V1.supports_sleep_mode(ktc) is True  # vLLM's default
        assert KvferryConnector.supports_sleep_mode(ktc) is False
        mc = vc.model_config
        mc.enable_sleep_mode = True  # set after ModelConfig's platform check (no GPU here)
        with pytest.raises(ValueError, match="KvferryConnector does not support sleep mode"):
            VllmConfig(device_config=DeviceConfig(device="cpu"), model_config=mc,
                       cache_config=CacheConfig(block_size=BS), kv_transfer_config=ktc)
    vc.model_config.enable_sleep_mode = True
    with pytest.raises(ValueError, match="does not support vLLM sleep mode"):
        scheduler(vc)  # vLLM's factory constructs the connector, whose __init__ refuses
    with pytest.raises(ValueError, match="does not support vLLM sleep mode"):
        KvferryConnector(vc, base.KVConnectorRole.WORKER, kv_cache_config())


# -- few, large descriptors: cross-layer blocks ------------------------------------------------
L, H, D = 4, 2, 8  # layers, KV heads, head size of the KV tensors built below
RUN_LOCAL, RUN_REMOTE = [3, 4, 5, 6], [10, 11, 12, 13]  # one contiguous run of 4 blocks


def _descriptors(kv: dict[str, torch.Tensor], heads_dim: int | None) -> tuple[int, int]:
    """(descriptors for one run of 4 blocks, KV heads located per block)."""
    lay = CpuBackend().describe(kv, NUM_BLOCKS, BS, heads_dim)
    loc, _ = layout.descriptors(lay, lay, RUN_LOCAL, RUN_REMOTE)
    return len(loc), lay.num_heads


def test_block_major_kv(tiny, monkeypatch):
    """One descriptor per run of blocks, on every version: 0.21-0.26 through the V1
    runner's cross-layer tensor, 0.32+ through the block-major layout kvferry asks for."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend as FA

    vc = vllm_config(tiny, {"hardware_backend": "cuda"})
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    if VERSION < (0, 32):
        from vllm.config import set_current_vllm_config
        from vllm.v1.kv_cache_interface import KVCacheTensor
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin as M

        conn = KvferryConnector(vc, base.KVConnectorRole.WORKER, kv_cache_config())
        assert conn.prefer_cross_layer_blocks is True
        assert KvferryConnector.get_required_kvcache_layout(vc) is None  # NHD/HND only here
        monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", conn)
        with set_current_vllm_config(vc):  # the backends read the layout from it
            if "indexes_kv_by_block_stride" in {f.name for f in dataclasses.fields(spec)}:
                # 0.24+: the V1 runner records this per backend (FlashAttention: True)
                spec = dataclasses.replace(spec, indexes_kv_by_block_stride=FA.indexes_kv_by_block_stride())
            groups = [[SimpleNamespace(backend=FA, kv_cache_spec=spec)]]
            uniform_args = (groups, "auto") if "cache_dtype" in inspect.signature(
                M.use_uniform_kv_cache).parameters else (groups,)
            assert M.use_uniform_kv_cache(*uniform_args)  # vLLM honours our preference
            kvc = KVCacheConfig(
                num_blocks=NUM_BLOCKS, kv_cache_groups=[KVCacheGroupSpec(names, spec)],
                kv_cache_tensors=[KVCacheTensor(size=spec.page_size_bytes * NUM_BLOCKS,
                                                shared_by=[n]) for n in names])
            per_layer, cross, backend = M.allocate_uniform_kv_caches(
                kvc, groups, "auto", torch.device("cpu"), [BS])
            heads = compat.kv_heads_dim(vc, {}, backend, cross_layer=True)
        assert _descriptors({"all_layers": cross}, heads) == (1, H)
        # Without it (V2 runner, or prefer_cross_layer_blocks off) every layer is its own
        # tensor shaped as FlashAttention asks: one descriptor per layer and K/V plane.
        shape = FA.get_kv_cache_shape(NUM_BLOCKS, BS, H, D)
        sep = {n: torch.zeros(shape, dtype=torch.float16) for n in names}
        planes = 2 if VERSION < (0, 24) else 1  # 0.21: (2, B, N, H, D); later (B, ...)
        assert _descriptors(sep, compat.kv_heads_dim(vc, {}, FA)) == (L * planes, H)
        assert set(per_layer) == set(names)
        return

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.worker.utils import allocate_kv_cache

    try:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    except ImportError:  # 0.33 moved it
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups

    def allocated(backend: Any, extra: dict[str, Any]) -> tuple[str, dict[str, torch.Tensor]]:
        cfg = vllm_config(tiny, extra)
        supported = [[x.name for x in get_supported_kv_cache_layouts([backend])]]
        chosen = resolve_kv_cache_layout(cfg, supported, [spec])  # the engine core's choice
        groups = [KVCacheGroupSpec(names, spec)]
        kvc = get_kv_cache_config_from_groups(cfg, groups, spec.page_size_bytes * L * NUM_BLOCKS)
        assert kvc.num_blocks == NUM_BLOCKS
        return chosen.name, allocate_kv_cache(kvc, torch.device("cpu"), chosen)

    assert KvferryConnector.get_required_kvcache_layout(vc) == compat.BLOCK_MAJOR_LAYOUT
    name, views = allocated(FA, {"hardware_backend": "cuda"})
    assert name == "BLHNC"  # FlashAttention accepts it: vLLM takes kvferry's request
    merged, heads = compat.block_major(views, compat.kv_heads_dim(vc, views))
    assert list(merged) == ["all_layers"] and _descriptors(merged, heads) == (1, H)
    (t,) = merged.values()
    for b in (0, 5):  # the merged block b is exactly every layer's block b, back to back
        starts = sorted(v[b].data_ptr() for v in views.values())
        assert starts[0] == t[b].data_ptr() and t[b].is_contiguous()
        assert starts == [t[b, i].data_ptr() for i in range(L)]
    assert _descriptors(views, 1)[0] == L * len(RUN_LOCAL)  # unmerged: per layer and block

    # CPU engines: no request (CPU attention reads LBHNC only), KV stays layer-major
    assert KvferryConnector.get_required_kvcache_layout(vllm_config(tiny)) is None
    name, views = allocated(CPUAttentionBackend, {})
    assert name == "LBHNC"
    assert compat.block_major(views, 1) == (views, 1)
    assert _descriptors(views, 1) == (L, H)
    cross_off = {"hardware_backend": "cuda", "cross_layer_blocks": False}
    assert KvferryConnector.get_required_kvcache_layout(vllm_config(tiny, cross_off)) is None
