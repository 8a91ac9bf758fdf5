"""Cluster launch plans for xPyD on trn2.48xlarge (Trainium2) and p5en.48xlarge (H200).

``plan(...)`` turns hosts + instance type + P/D counts + TP into exact per-host commands:
which NeuronCores / GPUs each engine owns (never overlapping, never past the instance),
EFA and NIXL environment, unique HTTP and side-channel ports, the vLLM server command
line with kvferry's ``--kv-transfer-config``, and the ``kvferry router`` command.
Nothing is executed here: ``kvferry launch --dry-run`` prints; without it, the scripts
are written out for ``ssh HOST bash -s < script`` (we never ssh on the user's behalf).
``--target k8s`` writes a Kustomize directory instead (scripts/k8s.py), whose engine
containers run the engines this module plans (one pod = one host with one engine).

Placement: engines are packed host by host (prefill first), each on a TP-aligned range
of devices. On Neuron a "device" is a logical NeuronCore (LNC=2 on trn2: 64 per host),
selected with NEURON_VISIBLE_DEVICES; on p5en it is a GPU (CUDA_VISIBLE_DEVICES). On p5en,
when a host carries both roles, FI_EFA_ENABLE_SHM_TRANSFER=0 is set for its engines: EFA's
shared-memory path cannot move device memory between P and D on one instance.

Neuron: vllm-neuron is selected by vLLM's platform plugin (installed with the Neuron SDK);
the environment of a trn2 engine is checked variable by variable against AWS's public
disaggregated-serving sample in :data:`NEURON_ENV_VS_AWS_SAMPLE` (what is adopted, what
kvferry keeps and why), and the per-host script starts with :func:`neuron_prelude` (the
EFA libfabric first on the loader path, the sample's libcuda stub where libcuda.so.1 is
missing). No NIXL backend is forced on Neuron: the memory backend tries device, mapped-HBM
and host registration and picks the backends each needs (kvferry/neuron/backend.py).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from kvferry.connectors.protocol.params import SECRET_ENV, deployment_secret

from .engines import CUDA_KVFERRY_ENV
from .neuron_env import (  # noqa: F401 (re-exported: the plan's Neuron environment)
    AWS_SAMPLE_ENV,
    NEURON_CCOM_BASE_PORT,
    NEURON_ENV_VS_AWS_SAMPLE,
    neuron_engine_env,
    neuron_prelude,
)


@dataclass(frozen=True)
class InstanceSpec:
    name: str
    backend: str  # memory backend: neuron | cuda
    unit: str  # what TP counts: "NeuronCore" | "GPU"
    chips: int
    cores_per_chip: int  # physical NeuronCores per chip (1 for GPUs)
    hbm_gib_per_chip: int
    efa_gbps: int

    def units(self, lnc: int = 2) -> int:
        """Devices one engine can take, e.g. 64 logical NeuronCores on trn2 at LNC=2."""
        if self.backend == "neuron":
            if lnc not in (1, 2):
                raise ValueError(f"LNC must be 1 or 2, got {lnc}")
            return self.chips * self.cores_per_chip // lnc
        return self.chips


INSTANCES: dict[str, InstanceSpec] = {
    "trn2.48xlarge": InstanceSpec("trn2.48xlarge", "neuron", "NeuronCore", 16, 8, 96, 3200),
    "p5en.48xlarge": InstanceSpec("p5en.48xlarge", "cuda", "GPU", 8, 1, 141, 3200),
}

# UCX over EFA: the SRD transport (UCX >= 1.19) plus CUDA copy/IPC for local GPU memory.
P5EN_UCX_TLS = "srd,cuda_copy,cuda_ipc,sm,self"
# vllm-neuron's default KV page (vllm_neuron/vllm/platform.py UNIFORM_NEURON_PAGE = 32).
NEURON_BLOCK_SIZE = 32


@dataclass
class EnginePlan:
    """One vLLM server: where it runs, what it owns, how it is started."""

    role: str  # prefill | decode
    index: int  # within its role
    host: str
    http_port: int
    side_channel_port: int  # first of ``tp`` consecutive ports (one per TP rank)
    devices: tuple[int, ...]
    env: dict[str, str]
    argv: list[str]

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def command(self) -> str:
        envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"env {envs} {shlex.join(self.argv)}"


@dataclass
class HostPlan:
    """Everything one host runs: its engines and, on the router host, the router."""

    host: str
    engines: list[EnginePlan] = field(default_factory=list)
    router: list[str] | None = None
    router_waits_for: list[str] = field(default_factory=list)
    prelude: list[str] = field(default_factory=list)  # shell lines before the engines

    def commands(self) -> list[str]:
        out = [e.command() for e in self.engines]
        if self.router:
            out.append(shlex.join(self.router))
        return out

    def script(self, secret: str, log_dir: str = "/tmp/kvferry") -> str:
        """A bash script that starts this host's processes in the background.

        ``secret`` must be the same on every host (params.deployment_secret)."""
        if not secret:
            raise PlanError(f"{SECRET_ENV} must not be empty")
        lines = ["#!/usr/bin/env bash", f"# kvferry launch plan for {self.host}", "set -euo pipefail",
                 f"export {SECRET_ENV}={shlex.quote(secret)}",
                 f"mkdir -p {shlex.quote(log_dir)}", *self.prelude]
        for e in self.engines:
            log = shlex.quote(f"{log_dir}/{e.name}.log")
            lines.append(f"nohup {e.command()} > {log} 2>&1 &")
            lines.append(f"echo $! > {shlex.quote(f'{log_dir}/{e.name}.pid')}")
        if self.router:
            lines.append(f"for u in {' '.join(self.router_waits_for)}; do")
            lines.append('  until curl -sf "$u/health" > /dev/null; do sleep 5; done')
            lines.append("done")
            log = shlex.quote(f"{log_dir}/router.log")
            lines.append(f"nohup {shlex.join(self.router)} > {log} 2>&1 &")
            lines.append(f"echo $! > {shlex.quote(f'{log_dir}/router.pid')}")
        return "\n".join(lines) + "\n"

    def ssh(self, script_path: str) -> str:
        return f"ssh {shlex.quote(self.host)} bash -s < {shlex.quote(script_path)}"


class PlanError(ValueError):
    """The requested topology does not fit the hardware or is inconsistent."""


def _place(n_units: int, hosts: list[str], tps: list[int], separate_from: int | None,
           spec: InstanceSpec) -> list[tuple[int, tuple[int, ...]]]:
    """(host index, device ids) per engine: pack hosts in order, TP-aligned ranges.

    ``separate_from``: engine index from which a fresh host is started (role split).
    """
    out = []
    host, used = 0, 0
    for i, tp in enumerate(tps):
        if tp < 1 or tp > n_units:
            raise PlanError(f"TP {tp} must be in 1..{n_units} ({spec.unit}s of one {spec.name}); "
                            "an engine cannot span instances")
        if i == separate_from and used:
            host, used = host + 1, 0
        start = -(-used // tp) * tp  # align the range to its TP size
        if start + tp > n_units:
            host, start = host + 1, 0
        if host >= len(hosts):
            raise PlanError(
                f"xPyD x TP exceeds the hardware: engines need {sum(tps)} {spec.unit}s "
                f"({', '.join(map(str, tps))}), {len(hosts)} x {spec.name} provide "
                f"{len(hosts) * n_units} ({n_units} each, TP-aligned, no engine across hosts)"
            )
        out.append((host, tuple(range(start, start + tp))))
        used = start + tp
    return out


def plan(
    hosts: list[str],
    instance_type: str,
    prefill: int,
    decode: int,
    tp: int,
    model: str,
    hardware_backend: str | None = None,
    decode_tp: int | None = None,
    http_port: int = 8100,
    side_channel_port: int = 5600,
    router_port: int = 8000,
    router_host: str | None = None,
    lnc: int = 2,
    nixl_backends: list[str] | None = None,
    separate_roles: bool = False,
    neuron_staging: str | None = None,
    extra_vllm_args: list[str] | None = None,
    python: str = "python",
) -> list[HostPlan]:
    """Per-host launch plans for ``prefill`` P and ``decode`` D engines of TP ``tp``."""
    if instance_type not in INSTANCES:
        raise PlanError(f"unknown instance type {instance_type!r}; known: {sorted(INSTANCES)}")
    spec = INSTANCES[instance_type]
    backend = hardware_backend or spec.backend
    if backend != spec.backend:
        raise PlanError(f"{instance_type} needs hardware backend {spec.backend!r}, got {backend!r}")
    if not hosts or len(set(hosts)) != len(hosts):
        raise PlanError("give at least one host, each once")
    if prefill < 1 or decode < 1:
        raise PlanError("need at least one prefill and one decode engine")
    n_units = spec.units(lnc)
    dtp = decode_tp or tp
    tps = [tp] * prefill + [dtp] * decode
    placed = _place(n_units, hosts, tps, prefill if separate_roles else None, spec)
    # Neuron: no forced backend, or it would override the registration fallback (the
    # memory backend picks LIBFABRIC for HBM, LIBFABRIC or UCX for host mirrors).
    backends = nixl_backends or ([] if backend == "neuron" else ["UCX"])

    roles_on: dict[int, set[str]] = {}
    for i, (h, _) in enumerate(placed):
        roles_on.setdefault(h, set()).add("prefill" if i < prefill else "decode")

    plans = [HostPlan(h, prelude=neuron_prelude() if backend == "neuron" else []) for h in hosts]
    next_http: dict[int, int] = {}
    next_side: dict[int, int] = {}
    for i, (h, devs) in enumerate(placed):
        role = "prefill" if i < prefill else "decode"
        idx = i if role == "prefill" else i - prefill
        port = next_http.get(h, http_port)
        side = next_side.get(h, side_channel_port)
        next_http[h] = port + 1
        next_side[h] = side + len(devs) + 1  # one per TP rank, then the lease-control port
        env = _engine_env(backend, devs, lnc, backends, shared=len(roles_on[h]) > 1,
                          staging=neuron_staging)
        argv = _vllm_argv(python, model, port, len(devs), backend, hosts[h], side, backends,
                          neuron_staging, extra_vllm_args or [])
        plans[h].engines.append(EnginePlan(role, idx, hosts[h], port, side, devs, env, argv))

    _check_no_port_clash(plans, router_host or hosts[0], router_port)
    engines = [e for p in plans for e in p.engines]
    router = [
        "kvferry", "router", "--host", "0.0.0.0", "--port", str(router_port),
        "--prefill", *[e.url for e in engines if e.role == "prefill"],
        "--decode", *[e.url for e in engines if e.role == "decode"],
        "--prefill-kv", ",".join(f"{e.host}:{e.side_channel_port}" for e in engines
                                 if e.role == "prefill"),
        "--decode-control", ",".join(f"{e.host}:{e.side_channel_port + len(e.devices)}"
                                     for e in engines if e.role == "decode"),
    ]
    rhost = router_host or hosts[0]
    target = next((p for p in plans if p.host == rhost), None)
    if target is None:
        target = HostPlan(rhost)
        plans.append(target)
    target.router = router
    target.router_waits_for = [e.url for e in engines]
    return plans


def _engine_env(backend: str, devs: tuple[int, ...], lnc: int, backends: list[str],
                shared: bool, staging: str | None) -> dict[str, str]:
    """One engine's environment; on Neuron every variable is accounted for in
    NEURON_ENV_VS_AWS_SAMPLE (adopted from AWS's sample, or kept with the reason)."""
    env = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}
    if shared or backend == "neuron":
        env["FI_EFA_ENABLE_SHM_TRANSFER"] = "0"
    if backend == "neuron":
        env.update(neuron_engine_env(devs, lnc, staging))
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devs))
        env.update(CUDA_KVFERRY_ENV)  # cross-layer KV blocks (see engines.py)
        if "UCX" in backends:
            env["UCX_TLS"] = P5EN_UCX_TLS
            env["UCX_NET_DEVICES"] = "all"
    return env


def _vllm_argv(python: str, model: str, port: int, tp: int, backend: str, host: str,
               side: int, backends: list[str], staging: str | None,
               extra: list[str]) -> list[str]:
    extra_cfg: dict[str, object] = {
        "hardware_backend": backend,
        "side_channel_host": host,
        "side_channel_port": side,
        "lease_control_port": side + tp,  # right after the TP ranks' side-channel ports
    }
    if backends:
        extra_cfg["nixl_backends"] = backends
    if backend == "neuron" and staging:
        extra_cfg["neuron_staging"] = staging
    kv_cfg = {
        "kv_connector": "KvferryConnector",
        "kv_connector_module_path": "kvferry.connectors.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra_cfg,
    }
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "0.0.0.0", "--port", str(port), "--tensor-parallel-size", str(tp)]
    if backend == "neuron":
        argv += ["--block-size", str(NEURON_BLOCK_SIZE)]
    argv += ["--kv-transfer-config", json.dumps(kv_cfg, separators=(",", ":"))]
    return argv + list(extra)


def _check_no_port_clash(plans: list[HostPlan], router_host: str, router_port: int) -> None:
    for p in plans:
        used: list[int] = []
        for e in p.engines:
            used += [e.http_port, *range(e.side_channel_port, e.side_channel_port + len(e.devices) + 1)]
            if "NEURON_RT_ROOT_COMM_ID" in e.env:  # the runtime's collective bootstrap
                used.append(int(e.env["NEURON_RT_ROOT_COMM_ID"].rsplit(":", 1)[1]))
        if p.host == router_host:
            used.append(router_port)
        if len(used) != len(set(used)):
            raise PlanError(f"port ranges overlap on {p.host}: choose bases further apart "
                            "(--http-port, --side-channel-port, --router-port)")


def read_hosts(hosts: str | None, hosts_file: Path | None) -> list[str]:
    """Hosts from ``--hosts a,b`` or a file (one per line, '#' comments)."""
    out: list[str] = []
    if hosts:
        out += [h.strip() for h in hosts.split(",") if h.strip()]
    if hosts_file:
        for ln in hosts_file.read_text().splitlines():
            ln = ln.split("#", 1)[0].strip()
            if ln:
                out.append(ln.split()[0])
    return out


launch_app = typer.Typer(help="Plan (and write scripts for) a P/D cluster launch.")


@launch_app.callback(invoke_without_command=True)
def launch(
    model: Annotated[str, typer.Option(help="HF model id or path")],
    instance_type: Annotated[str, typer.Option("--instance-type", "-i",
                                               help="trn2.48xlarge | p5en.48xlarge")],
    hosts: Annotated[str | None, typer.Option(help="comma-separated hosts")] = None,
    hosts_file: Annotated[Path | None, typer.Option(help="file with one host per line")] = None,
    prefill: Annotated[int, typer.Option(help="prefill engines")] = 1,
    decode: Annotated[int, typer.Option(help="decode engines")] = 1,
    tp: Annotated[int, typer.Option(help="tensor parallel size per engine")] = 8,
    decode_tp: Annotated[int | None, typer.Option(help="TP of decode engines (default --tp)")] = None,
    hardware_backend: Annotated[str | None, typer.Option(help="neuron | cuda")] = None,
    nixl_backend: Annotated[list[str] | None, typer.Option(help="NIXL backend(s)")] = None,
    lnc: Annotated[int, typer.Option(help="Neuron logical core config (trn2)")] = 2,
    separate_roles: Annotated[bool, typer.Option(help="never put P and D on one host")] = False,
    neuron_staging: Annotated[str | None, typer.Option(
        help="Neuron KV registration: auto | device | mapped | host")] = None,
    router_host: Annotated[str | None, typer.Option(help="default: first host")] = None,
    router_port: Annotated[int, typer.Option()] = 8000,
    http_port: Annotated[int, typer.Option(help="first engine HTTP port per host")] = 8100,
    side_channel_port: Annotated[int, typer.Option(help="first side-channel port per host")] = 5600,
    out_dir: Annotated[Path | None, typer.Option(
        help="write HOST.sh scripts (or, with --target k8s, the Kustomize directory) here")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print commands only")] = False,
    target: Annotated[str, typer.Option(help="ssh (per-host scripts) | k8s (Kustomize dir)")] = "ssh",
    image: Annotated[str, typer.Option(help="k8s: image with kvferry + vLLM")] = "kvferry:latest",
    namespace: Annotated[str, typer.Option(help="k8s: namespace")] = "kvferry",
    neuron_devices: Annotated[str, typer.Option(
        help="k8s trn2: plugin (aws.amazon.com/neuron + vpc.amazonaws.com/efa) | dra "
        "(ResourceClaims, AWS's disagg_serve_vllm sample)")] = "plugin",
    router_replicas: Annotated[int, typer.Option(help="k8s: router replicas (>= 2)")] = 2,
    redis_url: Annotated[str | None, typer.Option(
        help="k8s: external Redis for conversation state (default: deploy one)")] = None,
    service_monitor: Annotated[bool, typer.Option(help="k8s: add a ServiceMonitor")] = False,
    drain_seconds: Annotated[int, typer.Option(
        help="k8s: time in-flight streams get when a pod stops")] = 300,
) -> None:
    """Print per-host commands (--dry-run) or write one start script per host; with
    --target k8s, a Kustomize directory (or, with --dry-run, its files on stdout)."""
    if target == "k8s":
        _launch_k8s(dict(instance_type=instance_type, model=model, image=image,
                         namespace=namespace, prefill=prefill, decode=decode, tp=tp,
                         decode_tp=decode_tp, lnc=lnc, nixl_backends=nixl_backend or None,
                         neuron_staging=neuron_staging,
                         neuron_devices=neuron_devices, router_replicas=router_replicas,
                         redis_url=redis_url, service_monitor=service_monitor,
                         drain_s=drain_seconds, http_port=http_port,
                         side_channel_port=side_channel_port, router_port=router_port),
                    hardware_backend, out_dir, dry_run)
        return
    if target != "ssh":
        typer.echo(f"error: --target must be ssh or k8s, got {target!r}", err=True)
        raise typer.Exit(2)
    host_list = read_hosts(hosts, hosts_file)
    try:
        plans = plan(host_list, instance_type, prefill, decode, tp, model, hardware_backend,
                     decode_tp, http_port, side_channel_port, router_port, router_host, lnc,
                     nixl_backend or None, separate_roles, neuron_staging)
    except (PlanError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    secret = deployment_secret()  # without it on every host, D refuses every offer
    if dry_run:
        typer.echo("# on every host first (the same value everywhere):\n"
                   f"export {SECRET_ENV}={shlex.quote(secret)}")
    for p in plans:
        typer.echo(f"# ---- {p.host} ----")
        if dry_run:
            for line in p.prelude:
                typer.echo(line)
        for c in p.commands():
            typer.echo(c)
        if not dry_run:
            d = out_dir or Path("kvferry-launch")
            d.mkdir(parents=True, exist_ok=True)
            path = d / f"{p.host}.sh"
            path.touch(mode=0o700)
            path.chmod(0o700)  # it carries the deployment's secret
            path.write_text(p.script(secret))
            typer.echo(f"# start with: {p.ssh(str(path))}")


def _launch_k8s(kw: dict[str, Any], hardware_backend: str | None, out_dir: Path | None,
                dry_run: bool) -> None:
    """`--target k8s`: the secret is printed only by --dry-run, else only written."""
    from .k8s import K8S_VERSION, K8sSettings, dry_run_text, render_all, write_dir  # imports us

    settings = K8sSettings(**kw)
    spec = INSTANCES.get(settings.instance_type)
    try:
        if spec and hardware_backend and hardware_backend != spec.backend:
            raise PlanError(f"{settings.instance_type} needs hardware backend {spec.backend!r}, "
                            f"got {hardware_backend!r}")
        files = render_all(settings, deployment_secret())
    except (PlanError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if dry_run:
        typer.echo(dry_run_text(files), nl=False)
        return
    d = out_dir or Path("kvferry-k8s")
    for path in write_dir(d, files):
        kinds = ", ".join(o["kind"] for m in files if m.filename == path.name for o in m.objects)
        typer.echo(f"wrote {path} ({kinds})")
    typer.echo(f"# validated offline against Kubernetes {K8S_VERSION} schemas; apply with: "
               f"kubectl apply -k {shlex.quote(str(d))}")
