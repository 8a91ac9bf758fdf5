"""Kubernetes (EKS) manifests for a kvferry P/D fleet: ``kvferry launch --target k8s``.

Same engines as the ssh target: each role's container command is the ``EnginePlan`` that
``launch.plan`` builds (one pod = one host holding one engine), so the two targets cannot
drift. What Kubernetes adds is written here, each hardware/cloud setting with the public
source it follows (:data:`SOURCES`, also written as a comment at the top of each file):

- one Deployment per role; no LeaderWorkerSet: ``launch.plan`` refuses an engine wider
  than one trn2.48xlarge / p5en.48xlarge ("an engine cannot span instances"), so no
  engine here ever spans nodes;
- a headless Service per role (one A record per ready pod: the router's DNS discovery),
  the router Deployment (>= 2 replicas, conversation state in Redis) and its Service,
  the only one meant for clients;
- Redis (or ``--redis-url``), a Secret holding ``KVFERRY_SECRET`` (referenced through
  ``secretKeyRef`` only), PodDisruptionBudgets, NetworkPolicies, an optional
  ServiceMonitor, and on trn2 with ``--neuron-devices dra`` one ResourceClaimTemplate
  per role (AWS's disagg_serve_vllm sample).

Assumed, not verified on a cluster: a pod's Neuron devices (device plugin or DRA) are
numbered from 0 inside the container, as GPUs are (nvidia-dp), so the plan's
NEURON_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES of a node-to-itself engine (0..TP-1) apply;
trn2 has one EFA per Neuron device (the sample pairs 8 with 8); nodes preallocate 2 MiB
hugepages; p5en fits the sample's per-node cpu/memory budget.

Validated offline against the Kubernetes JSON schemas of :data:`K8S_VERSION` and the
ServiceMonitor CRD (tests/test_k8s.py); never applied to a real cluster here.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvferry.connectors.protocol.params import SECRET_ENV

from .launch import INSTANCES, EnginePlan, InstanceSpec, PlanError, plan
from .neuron_env import neuron_prelude

K8S_VERSION = "1.34.0"
"""Schemas the output is validated against. 1.34: resource.k8s.io/v1 (DRA GA), the
minimum of the EFA DRA driver (AWS EKS EFA docs)."""

SOURCES: dict[str, str] = {
    "neuron-dp": "AWS Neuron docs, EKS setup / Neuron device plugin "
                 "(awsdocs-neuron.readthedocs-hosted.com/en/latest/deploy/eks/setup.html): "
                 "aws.amazon.com/neuron allocates whole Neuron devices (all their cores)",
    "neuron-sample": "aws-neuron/aws-neuron-eks-samples disagg_serve_vllm (prefill-deploy.yaml "
                     "@b67a4f6, xl-lnc2-trn2-efa-rct.yaml @07dbf5f): DRA claim of neuron.aws.com "
                     "+ efa.networking.k8s.aws in one devicegroup8, LNC=2, /dev/shm in memory, "
                     "startup probe for the first Neuron compile, cpu 90 / memory 900Gi per "
                     "half node",
    "efa-eks": "AWS EKS user guide, Manage EFA devices on Amazon EKS "
               "(docs.aws.amazon.com/eks/latest/userguide/device-management-efa.html): EFA "
               "device plugin resource vpc.amazonaws.com/efa; EFA DRA driver needs K8s 1.34; "
               "node-efa.html example pods request hugepages-2Mi and IPC_LOCK for EFA memory "
               "registration",
    "llm-d-p5en": "llm-d/llm-d guides/pd-disaggregation/modelserver/gpu/vllm/aws "
                  "(kustomization.yaml @1a1626c, patch-prefill.yaml @1d0bfe7): p5en.48xlarge "
                  "nodeSelector, vpc.amazonaws.com/efa 2 per GPU (TP4 -> 8, TP1 -> 2), P/D "
                  "podAntiAffinity on kubernetes.io/hostname, IPC_LOCK",
    "nvidia-dp": "NVIDIA/k8s-device-plugin README: GPUs requested as nvidia.com/gpu limits; "
                 "the container sees its GPUs numbered from 0",
    "k8s": f"Kubernetes v{K8S_VERSION} API (downward API status.podIP, $(VAR) expansion in "
           "command, headless Services, NetworkPolicy, PodDisruptionBudget)",
    "prom-operator": "prometheus-operator/prometheus-operator "
                     "example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml "
                     "(v0.93.0, @6adcebc)",
}

POD_IP = "$(POD_IP)"  # expanded by the kubelet from the env var below (downward API)
PART_OF = "app.kubernetes.io/part-of"
COMPONENT = "app.kubernetes.io/component"
ROLES = ("prefill", "decode")

# trn2.48xlarge: 16 Neuron devices and 16 EFA devices (one per chip: the sample pairs 8 and
# 8 in a devicegroup8); p5en.48xlarge: 8 GPUs and 16 EFA (llm-d: 2 per GPU).
EFA_PER_DEVICE: dict[str, int] = {"trn2.48xlarge": 1, "p5en.48xlarge": 2}
# Per whole node, what an engine pod may request (scaled by its share of the node): the
# sample's cpu 90 / memory 900Gi for half a trn2.48xlarge (192 vCPU, 2 TiB). p5en.48xlarge
# has the same vCPU and memory; the numbers are assumed to fit it too.
NODE_CPU, NODE_MEMORY_GI = 180, 1800
HUGEPAGES_2MI = "5120Mi"  # efa-eks: the node-efa example pod's hugepages-2Mi request


@dataclass(frozen=True)
class K8sSettings:
    """What decides the manifests (the engine settings mirror ``launch.plan``'s)."""

    instance_type: str
    model: str
    image: str = "kvferry:latest"
    namespace: str = "kvferry"
    prefill: int = 1
    decode: int = 1
    tp: int = 8
    decode_tp: int | None = None
    lnc: int = 2
    nixl_backends: list[str] | None = None
    neuron_staging: str | None = None
    extra_vllm_args: list[str] = field(default_factory=list)
    neuron_devices: str = "plugin"  # plugin | dra (trn2)
    router_replicas: int = 2
    redis_url: str | None = None  # external Redis; None: deploy one
    redis_image: str = "redis:7.4-alpine"
    service_monitor: bool = False
    drain_s: int = 300  # how long in-flight streams get when a pod stops
    http_port: int = 8100
    side_channel_port: int = 5600
    router_port: int = 8000


class _Dumper(yaml.SafeDumper):
    """No &anchors / *aliases: each object reads on its own, as kubectl users expect."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    """Multi-line strings (the trn2 engine's bash script) as readable literal blocks."""
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


@dataclass(frozen=True)
class Manifest:
    """One file of the Kustomize directory: its objects and the sources they follow."""

    filename: str
    objects: list[dict[str, Any]]
    sources: tuple[str, ...] = ("k8s",)

    def render(self) -> str:
        head = ["# Generated by `kvferry launch --target k8s`; change it with overlays.",
                *(f"# follows: {SOURCES[s]}" for s in self.sources)]
        docs = [yaml.dump(o, Dumper=_Dumper, sort_keys=False, width=100) for o in self.objects]
        return "\n".join(head) + "\n" + "---\n".join(docs)


def role_plans(s: K8sSettings) -> dict[str, EnginePlan]:
    """Each role's engine from ``launch.plan`` itself, on a host named $(POD_IP) with the
    node to itself: the same argv and env an ssh host would run (one source)."""
    out: dict[str, EnginePlan] = {}
    for role, hosts in (("prefill", [POD_IP, "decode-host"]), ("decode", ["prefill-host", POD_IP])):
        plans = plan(hosts, s.instance_type, 1, 1, s.tp, s.model, decode_tp=s.decode_tp,
                     http_port=s.http_port, side_channel_port=s.side_channel_port,
                     router_port=s.router_port, lnc=s.lnc, nixl_backends=s.nixl_backends,
                     separate_roles=True, neuron_staging=s.neuron_staging,
                     extra_vllm_args=s.extra_vllm_args)
        out[role] = next(e for p in plans for e in p.engines if e.role == role)
        assert out[role].host == POD_IP
    return out


def engine_command(e: EnginePlan, prelude: list[str]) -> list[str]:
    """The container command: the plan's argv, after the host prelude when there is one
    (trn2: EFA's libfabric first on the loader path, the libcuda stub)."""
    if not prelude:
        return list(e.argv)
    return ["/bin/bash", "-c", "\n".join([*prelude, f"exec {shlex.join(e.argv)}"])]


def labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "kvferry", PART_OF: "kvferry", COMPONENT: component}


def name(component: str) -> str:
    return f"kvferry-{component}"


def secret_env(var: str, key: str) -> dict[str, Any]:
    return {"name": var, "valueFrom": {"secretKeyRef": {"name": name("secret"), "key": key}}}


def neuron_chips(spec: InstanceSpec, tp: int, lnc: int) -> int:
    """Whole Neuron devices holding ``tp`` logical cores (LNC=2: 4 per trn2 chip)."""
    return math.ceil(tp * lnc / spec.cores_per_chip)


def engine_resources(s: K8sSettings, role: str, tp: int) -> dict[str, Any]:
    """Requests = limits (extended resources and hugepages must be): accelerators, EFA,
    hugepages, and cpu/memory scaled by the node share."""
    spec = INSTANCES[s.instance_type]
    devs = neuron_chips(spec, tp, s.lnc) if spec.backend == "neuron" else tp
    share = devs / spec.chips  # of the node's Neuron devices or GPUs
    res: dict[str, Any] = {"cpu": str(max(4, int(NODE_CPU * share))),
                           "memory": f"{max(32, int(NODE_MEMORY_GI * share))}Gi",
                           "hugepages-2Mi": HUGEPAGES_2MI}
    dra = spec.backend == "neuron" and s.neuron_devices == "dra"
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


def engine_ports(e: EnginePlan) -> list[dict[str, Any]]:
    """HTTP, one side-channel port per TP rank, then the lease-control port."""
    tp = len(e.devices)
    ports = [{"name": "http", "containerPort": e.http_port, "protocol": "TCP"}]
    ports += [{"name": f"side-{r}", "containerPort": e.side_channel_port + r, "protocol": "TCP"}
              for r in range(tp)]
    ports.append({"name": "lease-control", "containerPort": e.side_channel_port + tp,
                  "protocol": "TCP"})
    return ports


def engine_env(e: EnginePlan) -> list[dict[str, Any]]:
    """POD_IP first (so $(POD_IP) in the command expands), then the plan's environment,
    then the secret by reference."""
    env: list[dict[str, Any]] = [{"name": "POD_IP", "valueFrom": {"fieldRef": {
        "fieldPath": "status.podIP"}}}]
    env += [{"name": k, "value": v} for k, v in sorted(e.env.items())]
    env.append(secret_env(SECRET_ENV, SECRET_ENV))
    return env


def engine_affinity(s: K8sSettings, role: str) -> dict[str, Any] | None:
    """p5en: P and D never share a node (llm-d-p5en prefers it; required here because
    EFA between two pods of one instance is refused). trn2 co-locates like the sample."""
    if INSTANCES[s.instance_type].backend != "cuda":
        return None
    other = "decode" if role == "prefill" else "prefill"
    return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "labelSelector": {"matchLabels": {PART_OF: "kvferry", COMPONENT: other}},
        "topologyKey": "kubernetes.io/hostname"}]}}


def engine_deployment(s: K8sSettings, role: str, e: EnginePlan) -> dict[str, Any]:
    """One role's engines: replicas = its count, one engine per pod."""
    spec = INSTANCES[s.instance_type]
    neuron = spec.backend == "neuron"
    health = {"httpGet": {"path": "/health", "port": "http"}}
    container: dict[str, Any] = {
        "name": "engine", "image": "kvferry",
        "command": engine_command(e, neuron_prelude() if neuron else []),
        "env": engine_env(e),
        "ports": engine_ports(e),
        "resources": engine_resources(s, role, len(e.devices)),
        # neuron-sample: a first Neuron compile takes many minutes (30 s x 570 there)
        "startupProbe": {**health, "periodSeconds": 30, "timeoutSeconds": 10,
                         "failureThreshold": 570 if neuron else 120},
        "readinessProbe": {**health, "periodSeconds": 10, "timeoutSeconds": 5,
                           "failureThreshold": 3},
        "livenessProbe": {**health, "periodSeconds": 30, "timeoutSeconds": 10,
                          "failureThreshold": 5},
        # Out of the headless Service first (the router stops picking it at its next DNS
        # refresh), while its in-flight streams finish; then SIGTERM.
        "lifecycle": {"preStop": {"sleep": {"seconds": s.drain_s}}},
        # efa-eks / llm-d-p5en: EFA registers (pins) memory
        "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds": s.drain_s + 60,
        "nodeSelector": {"node.kubernetes.io/instance-type": s.instance_type},
        "tolerations": [{"key": "aws.amazon.com/neuron" if neuron else "nvidia.com/gpu",
                         "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [container],
        # neuron-sample: /dev/shm as a memory-backed emptyDir
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "128Gi"}}],
    }
    if neuron and s.neuron_devices == "dra":
        pod["resourceClaims"] = [{"name": "neurons",
                                  "resourceClaimTemplateName": name(f"{role}-neuron-efa")}]
    affinity = engine_affinity(s, role)
    if affinity:
        pod["affinity"] = affinity
    count = s.prefill if role == "prefill" else s.decode
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name(role), "labels": labels(role)},
        "spec": {
            "replicas": count,
            "selector": {"matchLabels": labels(role)},
            # No spare accelerator node is assumed: replace pods one at a time in place.
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": {"metadata": {"labels": labels(role)}, "spec": pod},
        },
    }


def headless_service(role: str, e: EnginePlan) -> dict[str, Any]:
    """One A record per ready engine pod: what the router resolves to find the fleet."""
    ports = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"],
              "protocol": "TCP"} for p in engine_ports(e)]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name(role), "labels": labels(role)},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": False,
                     "selector": labels(role), "ports": ports}}


def router_argv(s: K8sSettings, plans: dict[str, EnginePlan]) -> list[str]:
    """The router's command line: resolve each role's headless Service every few seconds
    (one engine per A record, its side-channel / lease-control port fixed per role). The
    state URL comes from the Secret through $KVFERRY_STATE_URL, never an argument."""
    p, d = plans["prefill"], plans["decode"]
    return [
        "kvferry", "router", "--host", "0.0.0.0", "--port", str(s.router_port),
        "--health-interval", "5", "--eject-after", "3", "--drain-timeout", str(s.drain_s),
        "--prefill-dns", f"{name('prefill')}:{p.http_port}",
        "--decode-dns", f"{name('decode')}:{d.http_port}",
        "--prefill-kv-port", str(p.side_channel_port),
        "--decode-control-port", str(d.side_channel_port + len(d.devices)),
        "--dns-interval", "5",
    ]


def router_deployment(s: K8sSettings, plans: dict[str, EnginePlan]) -> dict[str, Any]:
    health = {"httpGet": {"path": "/health", "port": "http"}}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name("router"), "labels": labels("router")},
        "spec": {
            "replicas": s.router_replicas,
            "selector": {"matchLabels": labels("router")},
            "template": {"metadata": {"labels": labels("router")}, "spec": {
                "terminationGracePeriodSeconds": s.drain_s + 30,
                "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 100, "podAffinityTerm": {
                        "labelSelector": {"matchLabels": labels("router")},
                        "topologyKey": "kubernetes.io/hostname"}}]}},
                "containers": [{
                    "name": "router", "image": "kvferry",
                    "command": router_argv(s, plans),
                    "env": [secret_env(SECRET_ENV, SECRET_ENV),
                            secret_env("KVFERRY_STATE_URL", "STATE_URL")],
                    "ports": [{"name": "http", "containerPort": s.router_port, "protocol": "TCP"}],
                    "readinessProbe": {**health, "periodSeconds": 5, "failureThreshold": 2},
                    "livenessProbe": {**health, "periodSeconds": 15, "failureThreshold": 4},
                    # let the Service drop this pod before SIGTERM starts the router's drain
                    "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
                    "resources": {"requests": {"cpu": "2", "memory": "2Gi"},
                                  "limits": {"memory": "4Gi"}},
                }],
            }},
        },
    }


def router_service(s: K8sSettings) -> dict[str, Any]:
    """The only Service meant for clients (ClusterIP: front it with an Ingress or
    LoadBalancer of your choice)."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name("router"), "labels": labels("router")},
            "spec": {"type": "ClusterIP", "selector": labels("router"),
                     "ports": [{"name": "http", "port": s.router_port, "targetPort": "http",
                                "protocol": "TCP"}]}}


def redis_objects(s: K8sSettings) -> list[dict[str, Any]]:
    """A single in-memory Redis for conversation state: losing it costs reuse, never a
    request (the router treats every Redis failure as "no entry")."""
    dep = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name("redis"), "labels": labels("redis")},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels("redis")},
                 "strategy": {"type": "Recreate"},
                 "template": {"metadata": {"labels": labels("redis")}, "spec": {"containers": [{
                     "name": "redis", "image": s.redis_image,
                     "args": ["--save", "", "--appendonly", "no", "--maxmemory", "3gb",
                              "--maxmemory-policy", "volatile-ttl"],
                     "ports": [{"name": "redis", "containerPort": 6379, "protocol": "TCP"}],
                     "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
                     "resources": {"requests": {"cpu": "1", "memory": "4Gi"},
                                   "limits": {"memory": "4Gi"}}}]}}},
    }
    svc = {"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": name("redis"), "labels": labels("redis")},
           "spec": {"selector": labels("redis"),
                    "ports": [{"name": "redis", "port": 6379, "targetPort": "redis",
                               "protocol": "TCP"}]}}
    return [dep, svc]


def secret(s: K8sSettings, value: str) -> dict[str, Any]:
    state = s.redis_url or f"redis://{name('redis')}:6379/0"
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": name("secret"), "labels": labels("secret")},
            "type": "Opaque", "stringData": {SECRET_ENV: value, "STATE_URL": state}}


def pdbs(s: K8sSettings) -> list[dict[str, Any]]:
    """Voluntary evictions (node drains, upgrades) take one engine per role at a time
    and keep a router serving."""
    def pdb(component: str, rule: dict[str, Any]) -> dict[str, Any]:
        return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                "metadata": {"name": name(component), "labels": labels(component)},
                "spec": {**rule, "selector": {"matchLabels": labels(component)}}}
    return [pdb("prefill", {"maxUnavailable": 1}), pdb("decode", {"maxUnavailable": 1}),
            pdb("router", {"minAvailable": 1})]


def network_policies(s: K8sSettings) -> list[dict[str, Any]]:
    """Engines (HTTP, side channel, lease control, and the NIXL/UCX listeners, whose
    ports are ephemeral, hence all ports) and Redis accept only kvferry's own pods; the
    router accepts clients on its port. EFA's SRD traffic bypasses the kernel and so
    these policies: the node's EFA security group bounds it (efa-eks)."""
    kvferry_pods = {"podSelector": {"matchLabels": {PART_OF: "kvferry"}}}
    engine_sel = {"matchExpressions": [
        {"key": PART_OF, "operator": "In", "values": ["kvferry"]},
        {"key": COMPONENT, "operator": "In", "values": list(ROLES)}]}
    engine_from: list[dict[str, Any]] = [{"from": [kvferry_pods]}]
    router_from: list[dict[str, Any]] = [{"ports": [{"port": "http", "protocol": "TCP"}]}]
    if s.service_monitor:  # Prometheus scrapes the engines' /metrics too
        engine_from.append({"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {
            "app.kubernetes.io/name": "prometheus"}}}],
            "ports": [{"port": "http", "protocol": "TCP"}]})

    def policy(n: str, selector: dict[str, Any], ingress: list[dict[str, Any]]) -> dict[str, Any]:
        return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": {"name": name(n), "labels": labels("network")},
                "spec": {"podSelector": selector, "policyTypes": ["Ingress"],
                         "ingress": ingress}}
    out = [policy("engines-from-kvferry-only", engine_sel, engine_from),
           policy("router-clients", {"matchLabels": labels("router")}, router_from)]
    if not s.redis_url:
        out.append(policy("redis-from-router-only", {"matchLabels": labels("redis")},
                          [{"from": [{"podSelector": {"matchLabels": labels("router")}}],
                            "ports": [{"port": "redis", "protocol": "TCP"}]}]))
    return out


def service_monitor() -> dict[str, Any]:
    """Scrapes /metrics of the router and of every engine (each Service names its HTTP
    port ``http``)."""
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": {"name": name("metrics"), "labels": labels("metrics")},
            "spec": {"selector": {"matchExpressions": [
                         {"key": PART_OF, "operator": "In", "values": ["kvferry"]},
                         {"key": COMPONENT, "operator": "In",
                          "values": ["prefill", "decode", "router"]}]},
                     "endpoints": [{"port": "http", "path": "/metrics", "interval": "30s"}]}}


def check(s: K8sSettings) -> None:
    if s.instance_type not in INSTANCES:
        raise PlanError(f"unknown instance type {s.instance_type!r}; known: {sorted(INSTANCES)}")
    if s.router_replicas < 2:
        raise PlanError("--router-replicas must be >= 2 (one replica is a single point of failure)")
    if s.neuron_devices not in ("plugin", "dra"):
        raise PlanError(f"--neuron-devices must be plugin or dra, got {s.neuron_devices!r}")
    if s.neuron_devices == "dra" and INSTANCES[s.instance_type].backend != "neuron":
        raise PlanError("--neuron-devices dra is for trn2 (AWS's DRA sample)")
    if s.prefill < 1 or s.decode < 1:
        raise PlanError("need at least one prefill and one decode engine")
    if s.drain_s < 1:
        raise PlanError("--drain-seconds must be >= 1")


def manifests(s: K8sSettings, secret_value: str) -> list[Manifest]:
    """Every file of the Kustomize directory except kustomization.yaml."""
    check(s)
    plans = role_plans(s)
    backend = INSTANCES[s.instance_type].backend
    hw = ("neuron-dp", "neuron-sample", "efa-eks") if backend == "neuron" else (
        "nvidia-dp", "llm-d-p5en", "efa-eks")
    out = [Manifest("secret.yaml", [secret(s, secret_value)])]
    for role in ROLES:
        if backend == "neuron" and s.neuron_devices == "dra":
            out.append(Manifest(f"{role}-resourceclaimtemplate.yaml",
                                [resource_claim_template(s, role, len(plans[role].devices))],
                                ("neuron-sample", "efa-eks", "k8s")))
        out.append(Manifest(f"{role}-deployment.yaml",
                            [engine_deployment(s, role, plans[role])], (*hw, "k8s")))
        out.append(Manifest(f"{role}-service.yaml", [headless_service(role, plans[role])]))
    out.append(Manifest("router-deployment.yaml", [router_deployment(s, plans)]))
    out.append(Manifest("router-service.yaml", [router_service(s)]))
    if not s.redis_url:
        out.append(Manifest("redis.yaml", redis_objects(s)))
    out.append(Manifest("poddisruptionbudgets.yaml", pdbs(s)))
    out.append(Manifest("networkpolicies.yaml", network_policies(s), ("k8s", "efa-eks")))
    if s.service_monitor:
        out.append(Manifest("servicemonitor.yaml", [service_monitor()], ("prom-operator",)))
    return out


def kustomization(s: K8sSettings, files: list[Manifest]) -> Manifest:
    """Lists every file; the image is set here (`kustomize edit set image kvferry=...`)."""
    image: dict[str, str] = {"name": "kvferry", "newName": s.image}
    if ":" in s.image.rsplit("/", 1)[-1]:  # repo[:port]/name:tag
        image["newName"], image["newTag"] = s.image.rsplit(":", 1)
    return Manifest("kustomization.yaml", [{
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "namespace": s.namespace, "resources": [m.filename for m in files],
        "images": [image]}], ())


def render_all(s: K8sSettings, secret_value: str) -> list[Manifest]:
    files = manifests(s, secret_value)
    return [kustomization(s, files), *files]


def write_dir(out_dir: Path, files: list[Manifest]) -> list[Path]:
    """Writes the files; the Secret's readable by its owner only."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for m in files:
        path = out_dir / m.filename
        if m.filename == "secret.yaml":
            path.touch(mode=0o600)
            path.chmod(0o600)
        path.write_text(m.render())
        paths.append(path)
    return paths


def dry_run_text(files: list[Manifest]) -> str:
    """All files as one YAML stream (``---`` between files), each headed by its name."""
    return "".join(f"---\n# ==== {m.filename} ====\n{m.render()}" for m in files)
