"""Cluster launch plans for xPyD on trn2.48xlarge (Trainium2) and p5en.48xlarge (H200).

``plan(...)`` turns hosts + instance type + P/D counts + TP into exact per-host commands:
which NeuronCores / GPUs each engine owns (never overlapping, never past the instance),
unique HTTP and side-channel ports, each engine's spec for the one engine builder
(engines.py, with the instance type's fields from instances.py), and the ``kvferry
router`` command. Nothing is executed here.

Placement: engines are packed host by host (prefill first), each on a TP-aligned range
of devices, its ports after the previous engine's on that host.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from kvferry.connectors.protocol.params import SECRET_ENV

from .engines import HTTP_PORT, ROUTER_PORT, SIDE_CHANNEL_PORT, EngineSpec, engine_argv, engine_env
from .instances import DEFAULT_LNC, INSTANCES, InstanceSpec, launched_engine
from .neuron_env import neuron_prelude


class PlanError(ValueError):
    """The requested topology does not fit the hardware or is inconsistent."""


@dataclass(frozen=True)
class EnginePlan:
    """One vLLM server: where it runs (``spec.side_host``), what it owns, how it starts.
    (The one-line properties below name `spec`'s fields as a plan reads them; they share a
    shape, not logic.)"""

    index: int  # within its role
    spec: EngineSpec

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def host(self) -> str:
        return self.spec.side_host

    @property
    def http_port(self) -> int:
        return self.spec.port

    @property
    def side_channel_port(self) -> int:
        """First of ``tp`` consecutive ports (one per TP rank)."""
        return self.spec.side_channel_port

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(self.spec.devices or ())

    @property
    def env(self) -> dict[str, str]:
        return engine_env(self.spec)

    @property
    def argv(self) -> list[str]:
        return engine_argv(self.spec)

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


def instance(instance_type: str, hardware_backend: str | None = None) -> InstanceSpec:
    """The instance type, checked against a requested hardware backend."""
    if instance_type not in INSTANCES:
        raise PlanError(f"unknown instance type {instance_type!r}; known: {sorted(INSTANCES)}")
    spec = INSTANCES[instance_type]
    if hardware_backend and hardware_backend != spec.backend:
        raise PlanError(f"{instance_type} needs hardware backend {spec.backend!r}, "
                        f"got {hardware_backend!r}")
    return spec


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
    http_port: int = HTTP_PORT,
    side_channel_port: int = SIDE_CHANNEL_PORT,
    router_port: int = ROUTER_PORT,
    router_host: str | None = None,
    lnc: int = DEFAULT_LNC,
    nixl_backends: list[str] | None = None,
    separate_roles: bool = False,
    neuron_staging: str | None = None,
    extra_vllm_args: list[str] | None = None,
    python: str = "python",
    max_model_len: int | None = None,
) -> list[HostPlan]:
    """Per-host launch plans for ``prefill`` P and ``decode`` D engines of TP ``tp``."""
    spec = instance(instance_type, hardware_backend)
    if not hosts or len(set(hosts)) != len(hosts):
        raise PlanError("give at least one host, each once")
    if prefill < 1 or decode < 1:
        raise PlanError("need at least one prefill and one decode engine")
    n_units = spec.units(lnc)
    tps = [tp] * prefill + [decode_tp or tp] * decode
    placed = _place(n_units, hosts, tps, prefill if separate_roles else None, spec)
    backends = spec.nixl_backends(nixl_backends)

    roles_on: dict[int, set[str]] = {}
    for i, (h, _) in enumerate(placed):
        roles_on.setdefault(h, set()).add("prefill" if i < prefill else "decode")

    plans = [HostPlan(h, prelude=neuron_prelude() if spec.backend == "neuron" else []) for h in hosts]
    next_http: dict[int, int] = {}
    next_side: dict[int, int] = {}
    for i, (h, devs) in enumerate(placed):
        role = "prefill" if i < prefill else "decode"
        e = launched_engine(spec, role, model, hosts[h], next_http.get(h, http_port),
                            next_side.get(h, side_channel_port), devs, lnc=lnc,
                            nixl_backends=backends, shared=len(roles_on[h]) > 1,
                            neuron_staging=neuron_staging, max_model_len=max_model_len,
                            extra_args=extra_vllm_args or [], python=python)
        next_http[h], next_side[h] = e.port + 1, e.next_side_channel_port
        plans[h].engines.append(EnginePlan(i if role == "prefill" else i - prefill, e))

    rhost = router_host or hosts[0]
    _check_no_port_clash(plans, rhost, router_port)
    engines = [e for p in plans for e in p.engines]
    # One value per option (comma lists): `--prefill URL URL` is an extra argument to
    # click, and a router started with nohup from the host script would never run.
    router = [
        "kvferry", "router", "--host", "0.0.0.0", "--port", str(router_port),
        "--prefill", ",".join(e.url for e in engines if e.role == "prefill"),
        "--decode", ",".join(e.url for e in engines if e.role == "decode"),
        "--prefill-kv", ",".join(f"{e.host}:{e.side_channel_port}" for e in engines
                                 if e.role == "prefill"),
        "--decode-control", ",".join(f"{e.host}:{e.spec.control_port}"
                                     for e in engines if e.role == "decode"),
    ]
    target = next((p for p in plans if p.host == rhost), None)
    if target is None:
        target = HostPlan(rhost)
        plans.append(target)
    target.router = router
    target.router_waits_for = [e.url for e in engines]
    return plans


def _check_no_port_clash(plans: list[HostPlan], router_host: str, router_port: int) -> None:
    for p in plans:
        used: list[int] = []
        for e in p.engines:
            used += e.spec.ports
            env = e.env
            if "NEURON_RT_ROOT_COMM_ID" in env:  # the runtime's collective bootstrap
                used.append(int(env["NEURON_RT_ROOT_COMM_ID"].rsplit(":", 1)[1]))
        if p.host == router_host:
            used.append(router_port)
        if len(used) != len(set(used)):
            raise PlanError(f"port ranges overlap on {p.host}: choose bases further apart "
                            "(--http-port, --side-channel-port, --router-port)")
