"""FAKE of vllm-neuron's worker-side device checks, on a plain environment mapping (no
torch, no vLLM): what vllm-project/vllm-neuron ``vllm_neuron/vllm/worker/neuron_worker.py``
does with an engine's environment before the runtime starts.
"""

from __future__ import annotations

from collections.abc import Mapping

CCOM_BASE_PORT = 61234  # neuron_worker.py _CCOM_BASE_PORT
VISIBLE_CORES_REFUSED = ("NEURON_RT_VISIBLE_CORES cannot be used with multi-processing "
                         "execution on vLLM. Set NEURON_VISIBLE_DEVICES to control device "
                         "visibility.")


def parse_range_list(spec: str) -> list[int]:
    """"0-3,8" -> [0, 1, 2, 3, 8] (vllm_neuron.utils.hardware_config.parse_range_list)."""
    out: list[int] = []
    for part in spec.strip().split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def visible_devices(env: Mapping[str, str], local_world_size: int) -> list[int]:
    """NeuronWorker._get_visible_devices for one engine's environment."""
    if "NEURON_RT_VISIBLE_CORES" in env:
        raise RuntimeError(VISIBLE_CORES_REFUSED)
    cores = parse_range_list(env.get("NEURON_VISIBLE_DEVICES") or
                             ",".join(map(str, range(local_world_size))))
    if len(cores) != local_world_size:
        raise RuntimeError(f"Resolved {len(cores)} Neuron cores {cores} for this replica, but "
                           f"local_world_size={local_world_size}")
    return cores


def ccom_root(env: Mapping[str, str]) -> str:
    """The collective bootstrap address the engine's rank 0 uses (rendezvous_ccom_bootstrap:
    the NEURON_VISIBLE_DEVICES-derived port wins over an inherited NEURON_RT_ROOT_COMM_ID)."""
    master = env.get("MASTER_ADDR", "localhost")
    visible = env.get("NEURON_VISIBLE_DEVICES", "")
    first = visible.split(",")[0].split("-")[0].strip()
    if first.isdigit():
        return f"{master}:{CCOM_BASE_PORT + int(first)}"
    return env.get("NEURON_RT_ROOT_COMM_ID", "")
