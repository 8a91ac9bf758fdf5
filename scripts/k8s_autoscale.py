"""Autoscaling of the prefill and decode Deployments (``kvferry launch --target k8s``):
HorizontalPodAutoscalers (autoscaling/v2) or, with ``--autoscaler keda``, KEDA
ScaledObjects, on what kvferry's engines and router export to Prometheus.

Prefill scales on prompts waiting in its engines (vLLM's ``vllm:num_requests_waiting``: a
queue in front of P is TTFT growing) and on prefill legs the routers hold per P
(``kvferry_router_upstream_in_flight{role="prefill"}``); decode on the batch its engines run
(``vllm:num_requests_running``: a wider batch is a longer inter-token time), their KV use
(``vllm:kv_cache_usage_perc``) and the streams the routers hold per D. Each target is a
setting (``kvferry plan`` says which batch holds an inter-token SLO).

HPAs read them through the Prometheus Adapter (kubernetes-sigs/prometheus-adapter,
docs/config.md and docs/externalmetrics.md): engine metrics as Pods metrics of the custom
metrics API (rules keyed on the ``namespace``/``pod`` labels a ServiceMonitor scrape adds),
router metrics as External metrics (summed over router replicas, per ``role``).
``ADAPTER_RULES`` is the adapter configuration they need; it is written, as a comment,
at the top of autoscaling.yaml. KEDA's Prometheus scaler (keda.sh/docs/2.x/scalers/
prometheus) queries Prometheus itself. Neither was applied to a cluster here.

Against flapping: scale-up waits out a 60 s window and adds one engine a minute (an
accelerator engine takes minutes to start); scale-down only follows a load that stayed low
for 10 minutes and removes one engine per ``--drain-seconds`` window, so at most one
engine per role drains at a time (its preStop keeps it out of the router's DNS while its
in-flight streams finish: k8s.engine_deployment).
"""

from __future__ import annotations

from typing import Any

import yaml

from .k8s_render import Manifest
from .k8s_settings import K8sSettings, labels, name

# name -> (Prometheus series, HPA source): Pods metrics per engine pod, External per role
ENGINE_METRICS = {
    "kvferry_engine_requests_waiting": "vllm:num_requests_waiting",
    "kvferry_engine_requests_running": "vllm:num_requests_running",
    "kvferry_engine_kv_cache_usage": "vllm:kv_cache_usage_perc",
}
ROUTER_METRICS = {"kvferry_router_in_flight": "kvferry_router_upstream_in_flight"}
SCALE_UP_WINDOW_S = 60
SCALE_DOWN_WINDOW_S = 600
MAX_POLICY_PERIOD_S = 1800  # the HPA API's bound on periodSeconds


def _pod_rule(metric: str, series: str) -> dict[str, Any]:
    return {"seriesQuery": f'{{__name__="{series}",namespace!="",pod!=""}}',
            "resources": {"overrides": {"namespace": {"resource": "namespace"},
                                        "pod": {"resource": "pod"}}},
            "name": {"matches": f"^{series}$", "as": metric},
            "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)"}


def _external_rule(metric: str, series: str) -> dict[str, Any]:
    return {"seriesQuery": f'{{__name__="{series}",namespace!="",role!=""}}',
            "resources": {"overrides": {"namespace": {"resource": "namespace"}}},
            "name": {"matches": f"^{series}$", "as": metric},
            "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (role)"}


ADAPTER_RULES: dict[str, list[dict[str, Any]]] = {
    "rules": [_pod_rule(m, s) for m, s in ENGINE_METRICS.items()],
    "externalRules": [_external_rule(m, s) for m, s in ROUTER_METRICS.items()],
}


def role_targets(s: K8sSettings, role: str) -> list[tuple[str, float]]:
    """(metric, per-engine target) that drive ``role``'s replica count."""
    if role == "prefill":
        return [("kvferry_engine_requests_waiting", s.scale_prefill_waiting),
                ("kvferry_router_in_flight", s.scale_prefill_in_flight)]
    return [("kvferry_engine_requests_running", s.scale_decode_running),
            ("kvferry_engine_kv_cache_usage", s.scale_decode_kv_usage),
            ("kvferry_router_in_flight", s.scale_decode_running)]


def quantity(value: float) -> str:
    """A Kubernetes quantity: whole numbers plain, fractions in milli-units."""
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def behavior(s: K8sSettings) -> dict[str, Any]:
    """Stabilisation windows against flapping; one engine at a time each way."""
    return {
        "scaleUp": {"stabilizationWindowSeconds": SCALE_UP_WINDOW_S, "selectPolicy": "Max",
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]},
        "scaleDown": {"stabilizationWindowSeconds": SCALE_DOWN_WINDOW_S, "selectPolicy": "Min",
                      "policies": [{"type": "Pods", "value": 1, "periodSeconds":
                                    min(s.drain_s, MAX_POLICY_PERIOD_S)}]},
    }


def replica_bounds(s: K8sSettings, role: str) -> tuple[int, int]:
    """(min, max): the role's count from --prefill/--decode up to --max-prefill/--max-decode."""
    if role == "prefill":
        return s.prefill, s.max_prefill or 2 * s.prefill
    return s.decode, s.max_decode or 2 * s.decode


def hpa(s: K8sSettings, role: str) -> dict[str, Any]:
    low, high = replica_bounds(s, role)
    metrics: list[dict[str, Any]] = []
    for metric, target in role_targets(s, role):
        value = {"type": "AverageValue", "averageValue": quantity(target)}
        if metric in ENGINE_METRICS:
            metrics.append({"type": "Pods", "pods": {"metric": {"name": metric}, "target": value}})
        else:  # AverageValue of an External metric: the routers' sum over this role's replicas
            metrics.append({"type": "External", "external": {
                "metric": {"name": metric, "selector": {"matchLabels": {"role": role}}},
                "target": value}})
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": name(role), "labels": labels(role)},
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                        "name": name(role)},
                     "minReplicas": low, "maxReplicas": high, "metrics": metrics,
                     "behavior": behavior(s)}}


def promql(s: K8sSettings, role: str, metric: str) -> str:
    """The query KEDA runs for one metric: the role's total (KEDA divides by replicas)."""
    if metric in ENGINE_METRICS:
        return f'sum({ENGINE_METRICS[metric]}{{namespace="{s.namespace}",service="{name(role)}"}})'
    return f'sum({ROUTER_METRICS[metric]}{{namespace="{s.namespace}",role="{role}"}})'


def scaled_object(s: K8sSettings, role: str) -> dict[str, Any]:
    low, high = replica_bounds(s, role)
    triggers = [{"type": "prometheus", "name": metric.replace("_", "-"),
                 "metricType": "AverageValue",
                 "metadata": {"serverAddress": s.prometheus_url, "query": promql(s, role, metric),
                              "threshold": f"{target:g}"}}
                for metric, target in role_targets(s, role)]
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
            "metadata": {"name": name(role), "labels": labels(role)},
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                        "name": name(role)},
                     "minReplicaCount": low, "maxReplicaCount": high, "pollingInterval": 15,
                     "advanced": {"horizontalPodAutoscalerConfig": {"behavior": behavior(s)}},
                     "triggers": triggers}}


def autoscalers(s: K8sSettings) -> list[dict[str, Any]]:
    """One per engine role, of the kind --autoscaler asks for (none: fixed counts)."""
    make = {"hpa": hpa, "keda": scaled_object}.get(s.autoscaler)
    return [make(s, role) for role in ("prefill", "decode")] if make else []


def adapter_notes() -> str:
    """The Prometheus Adapter configuration the HPAs need, as its Helm chart's values."""
    values = {"rules": {"custom": ADAPTER_RULES["rules"], "external": ADAPTER_RULES["externalRules"]}}
    return ("The HPAs below read these metrics through the Prometheus Adapter; its Helm values\n"
            "(prometheus-community/prometheus-adapter; config.yaml takes the same lists as\n"
            "`rules:` and `externalRules:`):\n"
            + yaml.safe_dump(values, sort_keys=False, width=100))


def autoscaling_manifest(s: K8sSettings) -> Manifest:
    if s.autoscaler == "keda":
        return Manifest("autoscaling.yaml", autoscalers(s), ("keda", "k8s-hpa"))
    return Manifest("autoscaling.yaml", autoscalers(s), ("k8s-hpa", "prom-adapter"),
                    adapter_notes())
