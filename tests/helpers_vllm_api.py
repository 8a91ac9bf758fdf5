"""What the per-version vLLM checks share (tests/vllm_api_checks.py, vllm_scheduler_checks.py):
this version's real VllmConfig, KVCacheConfig and Scheduler built with kvferry's connector,
requests, and one scheduler step standing in for the model runner with the outputs it
would return.

A check module takes the fixtures by naming them at module level (``make = helpers_vllm_api.make``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
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
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvferry.connectors.protocol.params import SECRET_ENV
from kvferry.scripts.modelgen import write_model

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
