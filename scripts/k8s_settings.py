"""What decides the Kubernetes manifests (``kvferry launch --target k8s``), the public
sources each hardware/cloud setting follows, and the naming every object shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .engines import HTTP_PORT, ROUTER_PORT, SIDE_CHANNEL_PORT
from .instances import DEFAULT_LNC
from .plan import PlanError, instance

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
               "IPC_LOCK for EFA memory registration (its example pods' hugepages-2Mi request "
               "is not followed: libfabric-efa)",
    "libfabric-efa": "ofiwg/libfabric man/fi_efa.7.md (FI_EFA_USE_HUGE_PAGE: huge pages only "
                     "back the EFA provider's internal buffers, a small performance "
                     "advantage) and prov/util/src/util_buf.c (regular pages when none can "
                     "be had): EFA needs no hugepages on trn2 or p5en",
    "eks-netpol": "AWS EKS user guide, Limit Pod traffic with Kubernetes network policies "
                  "(docs.aws.amazon.com/eks/latest/userguide/cni-network-policy.html): the "
                  "Amazon VPC CNI enforces NetworkPolicies only with its network policy "
                  "agent on (add-on setting enableNetworkPolicy: \"true\"); otherwise they "
                  "are accepted and ignored",
    "llm-d-p5en": "llm-d/llm-d guides/pd-disaggregation/modelserver/gpu/vllm/aws "
                  "(kustomization.yaml @1a1626c, patch-prefill.yaml @1d0bfe7): p5en.48xlarge "
                  "nodeSelector, vpc.amazonaws.com/efa 2 per GPU (TP4 -> 8, TP1 -> 2), P/D "
                  "podAntiAffinity on kubernetes.io/hostname, IPC_LOCK",
    "nvidia-dp": "NVIDIA/k8s-device-plugin README: GPUs requested as nvidia.com/gpu limits; "
                 "the container sees its GPUs numbered from 0",
    "k8s": f"Kubernetes v{K8S_VERSION} API (downward API status.podIP, $(VAR) expansion in "
           "command, headless Services, NetworkPolicy, PodDisruptionBudget)",
    "k8s-hpa": "Kubernetes docs, Horizontal Pod Autoscaling (autoscaling/v2: Pods and External "
               "metrics, AverageValue targets, behavior.stabilizationWindowSeconds and scaling "
               "policies; leave spec.replicas out of a Deployment an HPA manages)",
    "prom-adapter": "kubernetes-sigs/prometheus-adapter docs/config.md and "
                    "docs/externalmetrics.md (rules / externalRules: seriesQuery, resources."
                    "overrides, name.matches/as, metricsQuery with <<.Series>>, "
                    "<<.LabelMatchers>>, <<.GroupBy>>)",
    "keda": "KEDA ScaledObject spec and Prometheus scaler (keda.sh/docs/2.x/reference/"
            "scaledobject-spec, /scalers/prometheus: serverAddress, query, threshold; "
            "advanced.horizontalPodAutoscalerConfig.behavior); CRD kedacore/keda "
            "config/crd/bases/keda.sh_scaledobjects.yaml @8b4f083ca",
    "prom-operator": "prometheus-operator/prometheus-operator "
                     "example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml "
                     "(v0.93.0, @6adcebc)",
}

POD_IP = "$(POD_IP)"  # expanded by the kubelet from the env var of that name (downward API)
PART_OF = "app.kubernetes.io/part-of"
COMPONENT = "app.kubernetes.io/component"


@dataclass(frozen=True)
class K8sSettings:
    """What decides the manifests (the engine settings mirror ``plan.plan``'s)."""

    instance_type: str
    model: str
    image: str | None = None  # engines; None: kvferry-cuda / kvferry-neuron (k8s_images)
    router_image: str | None = None  # None: kvferry-router
    namespace: str = "kvferry"
    prefill: int = 1
    decode: int = 1
    tp: int = 8
    decode_tp: int | None = None
    lnc: int = DEFAULT_LNC
    nixl_backends: list[str] | None = None
    neuron_staging: str | None = None
    extra_vllm_args: list[str] = field(default_factory=list)
    max_model_len: int | None = None
    neuron_devices: str = "plugin"  # plugin | dra (trn2)
    router_replicas: int = 2
    redis_url: str | None = None  # external Redis; None: deploy one
    redis_image: str = "redis:7.4-alpine"
    service_monitor: bool = False
    drain_s: int = 300  # how long in-flight streams get when a pod stops
    # autoscaling (k8s_autoscale.py): hpa | keda | none; replicas from prefill/decode up to max
    autoscaler: str = "hpa"
    max_prefill: int | None = None  # None: twice --prefill
    max_decode: int | None = None  # None: twice --decode
    scale_prefill_waiting: float = 2.0  # prompts waiting per prefill engine
    scale_prefill_in_flight: float = 4.0  # prefill legs the routers hold per prefill engine
    scale_decode_running: float = 32.0  # streams per decode engine (its batch)
    scale_decode_kv_usage: float = 0.8  # KV cache use per decode engine (0-1)
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090"  # KEDA's queries
    http_port: int = HTTP_PORT
    side_channel_port: int = SIDE_CHANNEL_PORT
    router_port: int = ROUTER_PORT

    @property
    def dra(self) -> bool:
        """Neuron and EFA devices through DRA claims (AWS's sample), not device plugins."""
        return self.neuron_devices == "dra"

    def check(self) -> None:
        spec = instance(self.instance_type)
        if self.router_replicas < 2:
            raise PlanError("--router-replicas must be >= 2 (one replica is a single point of failure)")
        if self.neuron_devices not in ("plugin", "dra"):
            raise PlanError(f"--neuron-devices must be plugin or dra, got {self.neuron_devices!r}")
        if self.dra and spec.backend != "neuron":
            raise PlanError("--neuron-devices dra is for trn2 (AWS's DRA sample)")
        if self.prefill < 1 or self.decode < 1:
            raise PlanError("need at least one prefill and one decode engine")
        if self.drain_s < 1:
            raise PlanError("--drain-seconds must be >= 1")
        if self.autoscaler not in ("hpa", "keda", "none"):
            raise PlanError(f"--autoscaler must be hpa, keda or none, got {self.autoscaler!r}")
        for flag, low, high in (("--max-prefill", self.prefill, self.max_prefill),
                                ("--max-decode", self.decode, self.max_decode)):
            if high is not None and high < low:
                raise PlanError(f"{flag} ({high}) must be >= the initial count ({low})")
        if min(self.scale_prefill_waiting, self.scale_prefill_in_flight,
               self.scale_decode_running, self.scale_decode_kv_usage) <= 0 \
                or self.scale_decode_kv_usage > 1:
            raise PlanError("scaling targets must be > 0 (KV use at most 1)")


def labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "kvferry", PART_OF: "kvferry", COMPONENT: component}


def name(component: str) -> str:
    return f"kvferry-{component}"


def secret_env(var: str, key: str) -> dict[str, Any]:
    """An env var read from the kvferry Secret (the value never appears in a manifest)."""
    return {"name": var, "valueFrom": {"secretKeyRef": {"name": name("secret"), "key": key}}}
