"""FAKE vllm-neuron: what kvferry's connector sees from AWS's vLLM plugin on a trn2 worker,
reproduced for CPU CI (no Neuron device, no Neuron SDK here).

Modelled on the public source of vllm-project/vllm-neuron (and its current forks):

* ``vllm_neuron/vllm/platform.py`` NeuronPlatform: device type ``neuron``,
  ``device_control_env_var = "NEURON_VISIBLE_DEVICES"``, ``UNIFORM_NEURON_PAGE = 32``,
  ``get_nixl_supported_devices() -> {"neuron": {"cuda"}}``;
* ``vllm_neuron/vllm/attention/attn.py`` NeuronAttentionBackend: HND per-layer cache
  ``(2, num_blocks, num_kv_heads, block_size, head_size)``;
* ``vllm_neuron/vllm/worker/neuron_worker.py`` NeuronWorker: refuses
  NEURON_RT_VISIBLE_CORES, one NeuronCore per worker process (= one TP rank), derives
  NEURON_RT_ROOT_COMM_ID as ``MASTER_ADDR:61234 + first visible core``, sets
  NEURON_RT_MAP_HBM=1 and starts the runtime before the KV connector registers memory.

Stand-ins: the KV tensors are CPU tensors of the real shape and dtype (their data_ptr()
plays the part of the HBM address upstream's NixlConnector registers), and the runtime is
the fake libnrt (tests/fakes/fake_libnrt.c). Nothing here is imported by kvferry.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvferry.connectors import compat
from kvferry.connectors.compat import KVConnectorRole
from kvferry.connectors.connector import KvferryConnector, KvferryMeta
from kvferry.connectors.scheduling.scheduler import StepMeta

from .vllm_neuron_env import (  # noqa: F401 (re-exported: the worker's device checks)
    CCOM_BASE_PORT,
    VISIBLE_CORES_REFUSED,
    ccom_root,
    parse_range_list,
    visible_devices,
)


class FakeNeuronPlatform:
    """FAKE of vllm_neuron.vllm.platform.NeuronPlatform (the parts a KV connector sees)."""

    device_name = "neuron"
    device_type = "neuron"
    device_control_env_var = "NEURON_VISIBLE_DEVICES"
    UNIFORM_NEURON_PAGE = 32

    @classmethod
    def get_nixl_supported_devices(cls) -> dict[str, set[str]]:
        return {cls.device_type: {"cuda"}}  # "cuda" here means device-to-device

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return f"neuron:{device_id}"


class FakeNeuronAttentionBackend:
    """FAKE of vllm_neuron.vllm.attention.attn.NeuronAttentionBackend."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return 2, num_blocks, num_kv_heads, block_size, head_size  # HND layout


@dataclass
class Model:
    """The served model's KV geometry (all TP ranks)."""

    num_layers: int = 2
    kv_heads: int = 2
    head_size: int = 16
    dtype: torch.dtype = torch.bfloat16


@dataclass
class FakeNeuronWorker:
    """FAKE vllm-neuron worker process: one TP rank on one NeuronCore, with kvferry's
    connector loaded the way vLLM loads it (worker role) and KV handed to it the way the
    model runner hands it: ``{layer_name: tensor (2, num_blocks, kv_heads, 32, head_size)}``."""

    engine_id: str
    extra_config: dict[str, Any]
    monkeypatch: pytest.MonkeyPatch
    rank: int = 0
    tp_size: int = 1
    num_blocks: int = 12
    model: Model = field(default_factory=Model)
    seed: int | None = None  # fill the KV with seeded bytes; None: zeros
    kv: dict[str, torch.Tensor] = field(init=False)
    connector: KvferryConnector = field(init=False)
    sent: set[str] = field(default_factory=set)
    recvd: set[str] = field(default_factory=set)
    bad_blocks: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        bs = FakeNeuronPlatform.UNIFORM_NEURON_PAGE
        heads = self.model.kv_heads // self.tp_size
        shape = FakeNeuronAttentionBackend.get_kv_cache_shape(self.num_blocks, bs, heads,
                                                              self.model.head_size)
        gen = torch.Generator().manual_seed(self.seed) if self.seed is not None else None
        self.kv = {}
        for layer in range(self.model.num_layers):
            t = torch.zeros(shape, dtype=self.model.dtype)  # stand-in for a neuron tensor
            if gen is not None:
                t.copy_(torch.randn(shape, generator=gen))
            self.kv[f"model.layers.{layer}.self_attn.attn"] = t
        layers = {name: SimpleNamespace(attn_backend=FakeNeuronAttentionBackend)
                  for name in self.kv}
        self.vllm_config = SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config=self.extra_config,
                                               engine_id=self.engine_id, kv_role="kv_both"),
            cache_config=SimpleNamespace(block_size=bs, num_gpu_blocks=self.num_blocks),
            parallel_config=SimpleNamespace(tensor_parallel_size=self.tp_size),
            model_config=SimpleNamespace(get_total_num_kv_heads=lambda: self.model.kv_heads),
            compilation_config=SimpleNamespace(static_forward_context=layers),
        )
        self.connector = KvferryConnector(self.vllm_config, KVConnectorRole.WORKER,
                                          SimpleNamespace(num_blocks=self.num_blocks))

    def register(self, kv_caches: Mapping[str, Any] | None = None) -> None:
        """Initialize the KV cache: the worker maps HBM (NEURON_RT_MAP_HBM=1, set by
        NeuronWorker before the runtime starts), then the runner registers the KV."""
        self.monkeypatch.setenv("NEURON_RT_MAP_HBM", "1")
        self.monkeypatch.setattr(compat, "tp_rank", lambda: self.rank)
        self.connector.register_kv_caches(dict(kv_caches if kv_caches is not None else self.kv))

    @property
    def backend(self) -> Any:
        return self.connector._backend

    def step(self, meta: StepMeta | None = None) -> None:
        """One engine step as the model runner drives the connector
        (KVConnectorModelRunnerMixin): bind, start_load_kv, forward, wait_for_save,
        get_finished, clear."""
        self.connector.bind_connector_metadata(KvferryMeta(meta or StepMeta()))
        self.connector.start_load_kv(None)
        self.connector.wait_for_save()
        sent, recvd = self.connector.get_finished(set())
        self.sent |= set(sent or ())
        self.recvd |= set(recvd or ())
        self.bad_blocks |= self.connector.get_block_ids_with_load_errors()
        self.connector.clear_connector_metadata()

    def run_until(self, what: str, req_id: str, timeout: float = 20.0) -> bool:
        """Idle steps until ``req_id`` shows up in ``sent``/``recvd`` (False on timeout)."""
        deadline = time.monotonic() + timeout
        while req_id not in getattr(self, what):
            if time.monotonic() > deadline:
                return False
            self.step()
            time.sleep(0.005)
        return True

    def block(self, layer: str, kv: int, block_id: int) -> bytes:
        """The bytes of one block of one layer's K (kv=0) or V (kv=1) plane."""
        return self.kv[layer][kv, block_id].contiguous().view(torch.uint8).numpy().tobytes()

    def close(self) -> None:
        self.connector.shutdown()
        staging = getattr(self.backend, "staging", None)
        if staging is not None:
            staging.close()
