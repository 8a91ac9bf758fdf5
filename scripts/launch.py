"""`kvferry launch`: per-host start scripts (ssh) or a Kustomize directory (k8s) for a P/D
fleet on trn2.48xlarge or p5en.48xlarge.

The plans come from plan.py (placement, ports, each engine's spec for the one engine
builder, engines.py) and instances.py (what each instance type needs). Nothing is executed
here: ``--dry-run`` prints; without it, the scripts are written out for ``ssh HOST bash -s <
script`` (we never ssh on the user's behalf). ``--target k8s`` writes a Kustomize directory
instead (k8s.py), whose engine containers run the engines plan.py plans (one pod = one host
with one engine).

Neuron: vllm-neuron is selected by vLLM's platform plugin (installed with the Neuron SDK);
the environment of a trn2 engine is checked variable by variable against AWS's public
disaggregated-serving sample in neuron_env.NEURON_ENV_VS_AWS_SAMPLE (what is adopted, what
kvferry keeps and why), and the per-host script starts with neuron_env.neuron_prelude (the
EFA libfabric first on the loader path, the sample's libcuda stub where libcuda.so.1 is
missing).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Any

import typer

from kvferry.connectors.protocol.params import SECRET_ENV, deployment_secret

from .engines import HTTP_PORT, ROUTER_PORT, SIDE_CHANNEL_PORT
from .instances import DEFAULT_LNC
from .k8s import render_all
from .k8s_render import dry_run_text, write_dir
from .k8s_settings import K8S_VERSION, K8sSettings
from .plan import PlanError, instance, plan


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
    tp: Annotated[int, typer.Option(help="tensor parallel size per engine")] = K8sSettings.tp,
    decode_tp: Annotated[int | None, typer.Option(help="TP of decode engines (default --tp)")] = None,
    hardware_backend: Annotated[str | None, typer.Option(help="neuron | cuda")] = None,
    nixl_backend: Annotated[list[str] | None, typer.Option(help="NIXL backend(s)")] = None,
    lnc: Annotated[int, typer.Option(help="Neuron logical core config (trn2)")] = DEFAULT_LNC,
    separate_roles: Annotated[bool, typer.Option(help="never put P and D on one host")] = False,
    neuron_staging: Annotated[str | None, typer.Option(
        help="Neuron KV registration: auto | device | mapped | host")] = None,
    router_host: Annotated[str | None, typer.Option(help="default: first host")] = None,
    router_port: Annotated[int, typer.Option()] = ROUTER_PORT,
    http_port: Annotated[int, typer.Option(help="first engine HTTP port per host")] = HTTP_PORT,
    side_channel_port: Annotated[int, typer.Option(
        help="first side-channel port per host")] = SIDE_CHANNEL_PORT,
    max_model_len: Annotated[int | None, typer.Option(
        help="engines' --max-model-len (default: the model's own)")] = None,
    out_dir: Annotated[Path | None, typer.Option(
        help="write HOST.sh scripts (or, with --target k8s, the Kustomize directory) here")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print commands only")] = False,
    target: Annotated[str, typer.Option(help="ssh (per-host scripts) | k8s (Kustomize dir)")] = "ssh",
    image: Annotated[str | None, typer.Option(
        help="k8s: engine image (default by hardware: kvferry-cuda / kvferry-neuron:VERSION, "
        "docker/*.Dockerfile)")] = None,
    router_image: Annotated[str | None, typer.Option(
        help="k8s: router image (default kvferry-router:VERSION, docker/router.Dockerfile)")] = None,
    namespace: Annotated[str, typer.Option(help="k8s: namespace")] = K8sSettings.namespace,
    neuron_devices: Annotated[str, typer.Option(
        help="k8s trn2: plugin (aws.amazon.com/neuron + vpc.amazonaws.com/efa) | dra "
        "(ResourceClaims, AWS's disagg_serve_vllm sample)")] = K8sSettings.neuron_devices,
    router_replicas: Annotated[int, typer.Option(
        help="k8s: router replicas (>= 2)")] = K8sSettings.router_replicas,
    redis_url: Annotated[str | None, typer.Option(
        help="k8s: external Redis for conversation state (default: deploy one)")] = None,
    service_monitor: Annotated[bool, typer.Option(help="k8s: add a ServiceMonitor")] = False,
    drain_seconds: Annotated[int, typer.Option(
        help="k8s: time in-flight streams get when a pod stops")] = K8sSettings.drain_s,
    autoscaler: Annotated[str, typer.Option(
        help="k8s: hpa (HorizontalPodAutoscalers via the Prometheus Adapter) | keda "
        "(ScaledObjects) | none (fixed --prefill/--decode)")] = K8sSettings.autoscaler,
    max_prefill: Annotated[int | None, typer.Option(
        help="k8s: most prefill engines the autoscaler may run (default 2 x --prefill)")] = None,
    max_decode: Annotated[int | None, typer.Option(
        help="k8s: most decode engines the autoscaler may run (default 2 x --decode)")] = None,
    scale_prefill_waiting: Annotated[float, typer.Option(
        help="k8s: prompts waiting per prefill engine to scale at")] = K8sSettings.scale_prefill_waiting,
    scale_prefill_in_flight: Annotated[float, typer.Option(
        help="k8s: prefill legs in flight per prefill engine to scale at")
    ] = K8sSettings.scale_prefill_in_flight,
    scale_decode_running: Annotated[float, typer.Option(
        help="k8s: streams per decode engine to scale at (`kvferry plan` gives the batch "
        "that holds an inter-token SLO)")] = K8sSettings.scale_decode_running,
    scale_decode_kv_usage: Annotated[float, typer.Option(
        help="k8s: KV cache use (0-1) per decode engine to scale at")
    ] = K8sSettings.scale_decode_kv_usage,
    prometheus_url: Annotated[str, typer.Option(
        help="k8s, --autoscaler keda: the Prometheus KEDA queries")] = K8sSettings.prometheus_url,
) -> None:
    """Print per-host commands (--dry-run) or write one start script per host; with
    --target k8s, a Kustomize directory (or, with --dry-run, its files on stdout)."""
    if target == "k8s":
        _launch_k8s(dict(instance_type=instance_type, model=model, image=image,
                         router_image=router_image,
                         namespace=namespace, prefill=prefill, decode=decode, tp=tp,
                         decode_tp=decode_tp, lnc=lnc, nixl_backends=nixl_backend or None,
                         neuron_staging=neuron_staging,
                         neuron_devices=neuron_devices, router_replicas=router_replicas,
                         redis_url=redis_url, service_monitor=service_monitor,
                         drain_s=drain_seconds, http_port=http_port,
                         autoscaler=autoscaler, max_prefill=max_prefill, max_decode=max_decode,
                         scale_prefill_waiting=scale_prefill_waiting,
                         scale_prefill_in_flight=scale_prefill_in_flight,
                         scale_decode_running=scale_decode_running,
                         scale_decode_kv_usage=scale_decode_kv_usage,
                         prometheus_url=prometheus_url,
                         side_channel_port=side_channel_port, router_port=router_port,
                         max_model_len=max_model_len),
                    hardware_backend, out_dir, dry_run)
        return
    if target != "ssh":
        typer.echo(f"error: --target must be ssh or k8s, got {target!r}", err=True)
        raise typer.Exit(2)
    host_list = read_hosts(hosts, hosts_file)
    try:
        plans = plan(host_list, instance_type, prefill, decode, tp, model, hardware_backend,
                     decode_tp, http_port, side_channel_port, router_port, router_host, lnc,
                     nixl_backend or None, separate_roles, neuron_staging,
                     max_model_len=max_model_len)
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
    settings = K8sSettings(**kw)
    try:
        instance(settings.instance_type, hardware_backend)
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
