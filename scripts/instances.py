"""What each instance type `kvferry launch` targets is, and what its engines need from it
(the ssh plans and the Kubernetes containers alike): devices, EFA/NIXL environment, and
the per-engine fields of the one engine builder (engines.EngineSpec) a launch sets.

On Neuron a "device" is a logical NeuronCore (LNC=2 on trn2: 64 per host), selected with
NEURON_VISIBLE_DEVICES; on p5en it is a GPU (CUDA_VISIBLE_DEVICES). On p5en, when a host
carries both roles, FI_EFA_ENABLE_SHM_TRANSFER=0 is set for its engines: EFA's
shared-memory path cannot move device memory between P and D on one instance. No NIXL
backend is forced on Neuron: the memory backend tries device, mapped-HBM and host
registration and picks the backends each needs (kvferry/neuron/backend.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .engines import EngineSpec

DEFAULT_LNC = 2
"""trn2's logical NeuronCore config: 2 physical cores per logical one (64 per host)."""
P5EN_UCX_TLS = "srd,cuda_copy,cuda_ipc,sm,self"
"""UCX over EFA: the SRD transport (UCX >= 1.19) plus CUDA copy/IPC for local GPU memory."""
# EFA needs no huge pages on either instance type: libfabric's EFA provider only backs its
# internal bounce buffers with them when it can, and falls back to regular pages otherwise
# (ofiwg/libfabric man/fi_efa.7.md FI_EFA_USE_HUGE_PAGE, "a small performance advantage";
# prov/util/src/util_buf.c); the bulk KV moves are RDMA on registered KV memory. Neither AWS's
# disagg_serve_vllm sample (trn2) nor llm-d's AWS guide (p5en) requests them. Off, so a pod
# that requests none (its hugetlb cgroup limit 0) never maps a huge page it may not touch.
EFA_ENV: dict[str, str] = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1",
                           "FI_EFA_USE_HUGE_PAGE": "0"}


@dataclass(frozen=True)
class InstanceSpec:
    """An accelerator instance type as the launch plans use it (devices, memory, EFA)."""

    name: str
    backend: str  # memory backend: neuron | cuda
    unit: str  # what TP counts: "NeuronCore" | "GPU"
    chips: int
    cores_per_chip: int  # physical NeuronCores per chip (1 for GPUs)
    hbm_gib_per_chip: int
    efa_gbps: int

    def units(self, lnc: int = DEFAULT_LNC) -> int:
        """Devices one engine can take, e.g. 64 logical NeuronCores on trn2 at LNC=2."""
        if self.backend == "neuron":
            if lnc not in (1, 2):
                raise ValueError(f"LNC must be 1 or 2, got {lnc}")
            return self.chips * self.cores_per_chip // lnc
        return self.chips

    def nixl_backends(self, chosen: list[str] | None) -> list[str]:
        """Neuron: none forced, or it would override the registration fallback (the memory
        backend picks LIBFABRIC for HBM, LIBFABRIC or UCX for host mirrors); GPUs: UCX."""
        return list(chosen or ([] if self.backend == "neuron" else ["UCX"]))

    def fabric_env(self, lnc: int, nixl_backends: list[str], shared: bool) -> dict[str, str]:
        """An engine's instance-type environment (the builder's ``env``): EFA only (no
        silent tcp fallback) with device RDMA and no huge pages (EFA_ENV), no EFA shared
        memory between P and D on one host, UCX over EFA, and on Neuron the plan's core
        numbering. Every Neuron variable is accounted for in neuron_env.NEURON_ENV_VS_AWS_SAMPLE."""
        env = dict(EFA_ENV)
        if shared:  # Neuron engines always have it (neuron_env.neuron_engine_env)
            env["FI_EFA_ENABLE_SHM_TRANSFER"] = "0"
        if self.backend == "neuron":
            env["NEURON_LOGICAL_NC_CONFIG"] = str(lnc)
        elif "UCX" in nixl_backends:
            env["UCX_NET_DEVICES"] = "all"
        return env

    def engine_fields(self, lnc: int, nixl_backends: list[str], shared: bool,
                      neuron_staging: str | None) -> dict[str, Any]:
        """The EngineSpec fields this instance type decides for a launched engine."""
        out: dict[str, Any] = {"backend": self.backend, "nixl_backends": tuple(nixl_backends),
                               "env": self.fabric_env(lnc, nixl_backends, shared)}
        if self.backend == "neuron":
            out["neuron_staging"] = neuron_staging
        elif "UCX" in nixl_backends:
            out["ucx_tls"] = P5EN_UCX_TLS
        return out


INSTANCES: dict[str, InstanceSpec] = {
    "trn2.48xlarge": InstanceSpec("trn2.48xlarge", "neuron", "NeuronCore", 16, 8, 96, 3200),
    "p5en.48xlarge": InstanceSpec("p5en.48xlarge", "cuda", "GPU", 8, 1, 141, 3200),
}


def launched_engine(instance: InstanceSpec, role: str, model: str, host: str, http_port: int,
                    side_channel_port: int, devices: tuple[int, ...], *, lnc: int,
                    nixl_backends: list[str], shared: bool, neuron_staging: str | None,
                    max_model_len: int | None, extra_args: list[str],
                    python: str) -> EngineSpec:
    """One engine of a launch (ssh host or pod): the builder's spec with the remote
    target's fields (listen on all interfaces, advertise ``host``, never probe the model
    path here) and the instance type's."""
    return EngineSpec(
        role=role,  # type: ignore[arg-type]
        model=model, port=http_port, host="0.0.0.0", side_channel_host=host,
        side_channel_port=side_channel_port, devices=devices, devices_per_engine=len(devices),
        max_model_len=max_model_len, extra_args=tuple(extra_args), python=python,
        model_on_this_host=False,
        **instance.engine_fields(lnc, nixl_backends, shared, neuron_staging))
