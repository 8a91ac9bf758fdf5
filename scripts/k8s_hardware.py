"""What an engine pod asks of its trn2.48xlarge / p5en.48xlarge node on EKS: accelerators
(device plugin or DRA claims), EFA devices, cpu/memory, node selection, and P/D
(anti-)affinity; each setting names the public source it follows (k8s_settings.SOURCES).
No hugepages: EFA on neither instance type needs them (libfabric-efa; instances.EFA_ENV
turns their use off), and neither public sample requests them; a request would leave pods
Pending on nodes that preallocate none.

Assumed, not verified on a cluster: a pod's Neuron devices (device plugin or DRA) are
numbered from 0 inside the container, as GPUs are (nvidia-dp), so the plan's
NEURON_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES of a node-to-itself engine (0..TP-1) apply;
trn2 has one EFA per Neuron device (the sample pairs 8 with 8); p5en fits the sample's
per-node cpu/memory budget.
"""

from __future__ import annotations

import math
from typing import Any

from .instances import INSTANCES, InstanceSpec
from .k8s_settings import COMPONENT, PART_OF, K8sSettings, labels, name

# trn2.48xlarge: 16 Neuron devices and 16 EFA devices (one per chip: the sample pairs 8 and
# 8 in a devicegroup8); p5en.48xlarge: 8 GPUs and 16 EFA (llm-d: 2 per GPU).
EFA_PER_DEVICE: dict[str, int] = {"trn2.48xlarge": 1, "p5en.48xlarge": 2}
# Per whole node, what an engine pod may request (scaled by its share of the node): the
# sample's cpu 90 / memory 900Gi for half a trn2.48xlarge (192 vCPU, 2 TiB). p5en.48xlarge
# has the same vCPU and memory; the numbers are assumed to fit it too.
NODE_CPU, NODE_MEMORY_GI = 180, 1800


def neuron_chips(spec: InstanceSpec, tp: int, lnc: int) -> int:
    """Whole Neuron devices holding ``tp`` logical cores (LNC=2: 4 per trn2 chip)."""
    return math.ceil(tp * lnc / spec.cores_per_chip)


def hardware_sources(s: K8sSettings) -> tuple[str, ...]:
    """The SOURCES an engine Deployment of this instance type follows."""
    if INSTANCES[s.instance_type].backend == "neuron":
        return ("neuron-dp", "neuron-sample", "efa-eks", "libfabric-efa")
    return ("nvidia-dp", "llm-d-p5en", "efa-eks", "libfabric-efa")


def engine_resources(s: K8sSettings, tp: int) -> dict[str, Any]:
    """Requests = limits (extended resources must be): accelerators, EFA, and cpu/memory
    scaled by the node share."""
    spec = INSTANCES[s.instance_type]
    devs = neuron_chips(spec, tp, s.lnc) if spec.backend == "neuron" else tp
    share = devs / spec.chips  # of the node's Neuron devices or GPUs
    res: dict[str, Any] = {"cpu": str(max(4, int(NODE_CPU * share))),
                           "memory": f"{max(32, int(NODE_MEMORY_GI * share))}Gi"}
    dra = spec.backend == "neuron" and s.dra
    if not dra:
        res["aws.amazon.com/neuron" if spec.backend == "neuron" else "nvidia.com/gpu"] = str(devs)
        res["vpc.amazonaws.com/efa"] = str(devs * EFA_PER_DEVICE[s.instance_type])
    out: dict[str, Any] = {"requests": dict(res), "limits": dict(res)}
    if dra:
        out["claims"] = [{"name": "neurons"}]
    return out


def resource_claim_template(s: K8sSettings, role: str, tp: int) -> dict[str, Any]:
    """neuron-sample's claim: the role's Neuron devices and as many EFA devices, from one
    devicegroup8 (same PCIe/NUMA group) when they fit in one, with the plan's LNC."""
    spec = INSTANCES[s.instance_type]
    chips = neuron_chips(spec, tp, s.lnc)
    devices: dict[str, Any] = {
        "requests": [
            {"name": "neurons", "exactly": {
                "deviceClassName": "neuron.aws.com", "allocationMode": "ExactCount",
                "count": chips,
                "selectors": [{"cel": {"expression": "device.attributes['neuron.aws.com']"
                                                     f".instanceType == '{s.instance_type}'"}}]}},
            {"name": "efas", "exactly": {"deviceClassName": "efa.networking.k8s.aws",
                                         "allocationMode": "ExactCount",
                                         "count": chips * EFA_PER_DEVICE[s.instance_type]}},
        ],
        "config": [{"requests": ["neurons"], "opaque": {"driver": "neuron.aws.com", "parameters": {
            "apiVersion": "neuron.aws.com/v1", "kind": "NeuronConfig",
            "logicalNeuronCore": s.lnc}}}],
    }
    if chips <= 8:  # a whole node (16 chips) spans both devicegroup8s: no such constraint
        devices["constraints"] = [{"matchAttribute": "resource.aws.com/devicegroup8_id",
                                   "requests": ["neurons", "efas"]}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name(f"{role}-neuron-efa"), "labels": labels(role)},
            "spec": {"spec": {"devices": devices}}}


def engine_affinity(s: K8sSettings, role: str) -> dict[str, Any] | None:
    """p5en: P and D never share a node (llm-d-p5en prefers it; required here because
    EFA between two pods of one instance is refused). trn2 co-locates like the sample."""
    if INSTANCES[s.instance_type].backend != "cuda":
        return None
    other = "decode" if role == "prefill" else "prefill"
    return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "labelSelector": {"matchLabels": {PART_OF: "kvferry", COMPONENT: other}},
        "topologyKey": "kubernetes.io/hostname"}]}}


def engine_pod_hardware(s: K8sSettings, role: str) -> dict[str, Any]:
    """The pod spec fields that place an engine on its instance type's nodes."""
    neuron = INSTANCES[s.instance_type].backend == "neuron"
    pod: dict[str, Any] = {
        "nodeSelector": {"node.kubernetes.io/instance-type": s.instance_type},
        "tolerations": [{"key": "aws.amazon.com/neuron" if neuron else "nvidia.com/gpu",
                         "operator": "Exists", "effect": "NoSchedule"}],
    }
    if neuron and s.dra:
        pod["resourceClaims"] = [{"name": "neurons",
                                  "resourceClaimTemplateName": name(f"{role}-neuron-efa")}]
    affinity = engine_affinity(s, role)
    if affinity:
        pod["affinity"] = affinity
    return pod
