"""Kubernetes (EKS) manifests for a kvferry P/D fleet: ``kvferry launch --target k8s``.

Same engines as the ssh target: each role's container command is the ``EnginePlan`` that
``plan.plan`` builds (one pod = one host holding one engine), whose argv and env come from
the one engine builder (engines.py) that `kvferry up` uses too, so the targets cannot
drift; the pod IP (downward API) is the engine's side-channel host. What Kubernetes adds
is built here (objects), in k8s_hardware.py (what a pod asks of its trn2/p5en node, each
setting with the public source it follows: k8s_settings.SOURCES, also written as a comment
at the top of each file) and k8s_render.py (files):

- one Deployment per role; no LeaderWorkerSet: ``plan.plan`` refuses an engine wider
  than one trn2.48xlarge / p5en.48xlarge ("an engine cannot span instances"), so no
  engine here ever spans nodes;
- a headless Service per role (one A record per ready pod: the router's DNS discovery),
  the router Deployment (>= 2 replicas, conversation state in Redis) and its Service,
  the only one meant for clients;
- Redis (or ``--redis-url``), a Secret holding ``KVFERRY_SECRET`` (referenced through
  ``secretKeyRef`` only), PodDisruptionBudgets, NetworkPolicies, an optional
  ServiceMonitor, and on trn2 with ``--neuron-devices dra`` one ResourceClaimTemplate
  per role (AWS's disagg_serve_vllm sample);
- per engine role a HorizontalPodAutoscaler, or a KEDA ScaledObject (``--autoscaler``), on
  the engines' and router's metrics (k8s_autoscale.py); the Deployments then leave their
  replica count to it.

Validated offline against the Kubernetes JSON schemas of ``K8S_VERSION`` and the
ServiceMonitor CRD (tests/test_k8s.py); never applied to a real cluster here.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import shlex
from typing import Any

from kvferry.connectors.protocol.params import SECRET_ENV
from kvferry.router.wire.headers import OPERATOR_TOKEN_ENV

from .engines import ROLES
from .instances import INSTANCES
from .k8s_autoscale import autoscaling_manifest
from .k8s_hardware import (
    engine_pod_hardware,
    engine_resources,
    hardware_sources,
    resource_claim_template,
)
from .k8s_images import ENGINE_PLACEHOLDER, ROUTER_PLACEHOLDER, role_images
from .k8s_render import Manifest, kustomization
from .k8s_settings import COMPONENT, PART_OF, POD_IP, K8sSettings, labels, name, secret_env
from .neuron_env import neuron_prelude
from .plan import EnginePlan, plan


def role_plans(s: K8sSettings) -> dict[str, EnginePlan]:
    """Each role's engine from ``plan.plan`` itself, on a host named $(POD_IP) with the
    node to itself: the same argv and env an ssh host would run (one source)."""
    out: dict[str, EnginePlan] = {}
    for role, hosts in (("prefill", [POD_IP, "decode-host"]), ("decode", ["prefill-host", POD_IP])):
        plans = plan(hosts, s.instance_type, 1, 1, s.tp, s.model, decode_tp=s.decode_tp,
                     http_port=s.http_port, side_channel_port=s.side_channel_port,
                     router_port=s.router_port, lnc=s.lnc, nixl_backends=s.nixl_backends,
                     separate_roles=True, neuron_staging=s.neuron_staging,
                     extra_vllm_args=s.extra_vllm_args, max_model_len=s.max_model_len)
        out[role] = next(e for p in plans for e in p.engines if e.role == role)
        assert out[role].host == POD_IP
    return out


def engine_command(e: EnginePlan, prelude: list[str]) -> list[str]:
    """The container command: the plan's argv, after the host prelude when there is one
    (trn2: EFA's libfabric first on the loader path, the libcuda stub)."""
    if not prelude:
        return list(e.argv)
    return ["/bin/bash", "-c", "\n".join([*prelude, f"exec {shlex.join(e.argv)}"])]


def engine_ports(e: EnginePlan) -> list[dict[str, Any]]:
    """HTTP, one side-channel port per TP rank, then the lease-control port."""
    ports = [{"name": "http", "containerPort": e.http_port, "protocol": "TCP"}]
    ports += [{"name": f"side-{r}", "containerPort": port, "protocol": "TCP"}
              for r, port in enumerate(e.spec.side_ports)]
    ports.append({"name": "lease-control", "containerPort": e.spec.control_port,
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


def engine_deployment(s: K8sSettings, role: str, e: EnginePlan) -> dict[str, Any]:
    """One role's engines: replicas = its count, one engine per pod."""
    neuron = INSTANCES[s.instance_type].backend == "neuron"
    health = {"httpGet": {"path": "/health", "port": "http"}}
    container: dict[str, Any] = {
        "name": "engine", "image": ENGINE_PLACEHOLDER,
        "command": engine_command(e, neuron_prelude() if neuron else []),
        "env": engine_env(e),
        "ports": engine_ports(e),
        "resources": engine_resources(s, len(e.devices)),
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
    hw = engine_pod_hardware(s, role)
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds": s.drain_s + 60,
        "nodeSelector": hw.pop("nodeSelector"),
        "tolerations": hw.pop("tolerations"),
        "containers": [container],
        # neuron-sample: /dev/shm as a memory-backed emptyDir
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "128Gi"}}],
        **hw,  # DRA claims, P/D anti-affinity
    }
    count = s.prefill if role == "prefill" else s.decode
    # With an autoscaler the count is its minimum, and no replicas here: re-applying the
    # files would otherwise reset what it scaled to (k8s-hpa).
    replicas = {"replicas": count} if s.autoscaler == "none" else {}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name(role), "labels": labels(role)},
        "spec": {
            **replicas,
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
        "--decode-control-port", str(d.spec.control_port),
        "--dns-interval", "5",
        "--api-keys-file", f"{API_KEYS_DIR}/{API_KEYS_FILE}",
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
                    "name": "router", "image": ROUTER_PLACEHOLDER,
                    "command": router_argv(s, plans),
                    "env": [secret_env(SECRET_ENV, SECRET_ENV),
                            secret_env("KVFERRY_STATE_URL", "STATE_URL"),
                            secret_env(OPERATOR_TOKEN_ENV, "OPERATOR_TOKEN")],
                    # a mounted Secret changes in place: keys rotate without a restart
                    "volumeMounts": [{"name": "api-keys", "mountPath": API_KEYS_DIR,
                                      "readOnly": True}],
                    "ports": [{"name": "http", "containerPort": s.router_port, "protocol": "TCP"}],
                    "readinessProbe": {**health, "periodSeconds": 5, "failureThreshold": 2},
                    "livenessProbe": {**health, "periodSeconds": 15, "failureThreshold": 4},
                    # let the Service drop this pod before SIGTERM starts the router's drain
                    "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
                    "resources": {"requests": {"cpu": "2", "memory": "2Gi"},
                                  "limits": {"memory": "4Gi"}},
                }],
                "volumes": [{"name": "api-keys", "secret": {"secretName": name("api-keys")}}],
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
            "type": "Opaque", "stringData": {SECRET_ENV: value, "STATE_URL": state,
                                             "OPERATOR_TOKEN": derived(value, "operator")}}


API_KEYS_DIR = "/etc/kvferry/api-keys"
API_KEYS_FILE = "keys.json"


def derived(value: str, purpose: str) -> str:
    """A credential derived from the deployment secret (reproducible manifests, nothing
    new to keep): read it back with `kubectl get secret`; replace it there to rotate."""
    return hmac.new(value.encode(), f"kvferry/{purpose}".encode(), hashlib.sha256).hexdigest()


def api_keys_secret(value: str) -> dict[str, Any]:
    """The router's API keys (`kvferry router --api-keys-file`): one key, id `default`;
    add or rotate keys by editing the Secret (the router re-reads the mounted file)."""
    keys = json.dumps({"default": "sk-" + derived(value, "api-key/default")[:40]})
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": name("api-keys"), "labels": labels("secret")},
            "type": "Opaque", "stringData": {API_KEYS_FILE: keys}}


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
    these policies: the node's EFA security group bounds it (efa-eks). On EKS they are
    enforced only where the VPC CNI's network policy agent is on (eks-netpol, written at
    the top of the file): without it every pod accepts every peer."""
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


def manifests(s: K8sSettings, secret_value: str) -> list[Manifest]:
    """Every file of the Kustomize directory except kustomization.yaml."""
    s.check()
    plans = role_plans(s)
    backend = INSTANCES[s.instance_type].backend
    hw = hardware_sources(s)
    out = [Manifest("secret.yaml", [secret(s, secret_value), api_keys_secret(secret_value)])]
    for role in ROLES:
        if backend == "neuron" and s.dra:
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
    out.append(Manifest("networkpolicies.yaml", network_policies(s),
                        ("k8s", "efa-eks", "eks-netpol")))
    if s.service_monitor:
        out.append(Manifest("servicemonitor.yaml", [service_monitor()], ("prom-operator",)))
    if s.autoscaler != "none":
        out.append(autoscaling_manifest(s))
    return out


def render_all(s: K8sSettings, secret_value: str) -> list[Manifest]:
    files = manifests(s, secret_value)
    images = role_images(s.instance_type, s.image, s.router_image)
    return [kustomization(images, s.namespace, files), *files]


