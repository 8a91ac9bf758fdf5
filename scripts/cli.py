"""`kvferry` command line: model, router, up, run, demo.

`kvferry run` (= `kvferry up --demo`) is the one-liner: generate the tiny model, start one
prefill engine, one decode engine and the router, wait for all /health, run the demo
conversation, stop everything (process groups, no orphans) and exit with the demo's code.
"""

from __future__ import annotations

import logging
import shlex
import signal
import socket
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer

from kvferry.connectors.protocol.params import SECRET_ENV, deployment_secret

from .bench import bench
from .chaos import chaos
from .demo import run_demo
from .engines import BACKENDS, CONNECTORS, ROLES, EngineSpec, engine_argv, engine_env, vllm_engine_id
from .launch import launch_app
from .modelgen import SHAPES, write_model
from .procs import Child, StartupError, died_message, first_dead, stop_all, wait_healthy

STATE_ENV = "KVFERRY_STATE_URL"
"""Where `kvferry router` (and so `kvferry up`) takes `--state` from when it is not given."""

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="kvferry: prefill/decode disaggregated serving on vLLM.")

app.add_typer(launch_app, name="launch")
app.command(name="bench")(bench)
app.command(name="chaos")(chaos)

STATE_DIR = Path(".kvferry")
EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}


class Shutdown(Exception):
    """Raised from SIGTERM/SIGHUP handlers so `finally` blocks stop the children."""


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    raise Shutdown(signal.Signals(signum).name)


def _choice(value: str, allowed: tuple[str, ...], flag: str) -> str:
    if value not in allowed:
        raise typer.BadParameter(f"{value!r} not in {', '.join(allowed)}", param_hint=flag)
    return value


@app.command()
def model(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the model into.")],
    shape: Annotated[str, typer.Option(help=f"One of: {', '.join(SHAPES)}.")] = "tiny",
    weights: Annotated[bool, typer.Option(
        help="Also write deterministic random weights (small shapes).")] = False,
) -> None:
    """Write a model dir (config + locally trained tokenizer [+ generated weights])."""
    _choice(shape, tuple(SHAPES), "--shape")
    typer.echo(str(write_model(out_dir, shape, weights)))


@app.command()
def router(
    prefill: Annotated[list[str] | None, typer.Option(
        help="Prefill engine URL (repeat or comma-list).")] = None,
    decode: Annotated[list[str] | None, typer.Option(
        help="Decode engine URL (repeat or comma-list).")] = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    mode: Annotated[str, typer.Option(help="Default transfer mode: pull|push.")] = "pull",
    prefill_kv: Annotated[list[str] | None, typer.Option(
        help="kvferry side channel host:port of each prefill engine, same order as --prefill "
        "(repeat or comma-list); needed for push mode.")] = None,
    decode_control: Annotated[list[str] | None, typer.Option(
        help="kvferry lease-control host:port of each decode engine, same order as --decode "
        "(repeat or comma-list); enables conversation KV reuse.")] = None,
    prefill_engine_id: Annotated[list[str] | None, typer.Option(
        help="KV engine id of each prefill engine, same order as --prefill: only to drive "
        "vLLM's own NixlPushConnector (with --prefill-kv naming its side channels).")] = None,
    lease_ttl: Annotated[float | None, typer.Option(
        help="Lease TTL (s) asked of decode per turn; default decode's own.")] = None,
    connect_timeout: float = 3.0,
    prefill_timeout: float = 300.0,
    decode_timeout: float = 300.0,
    state: Annotated[str, typer.Option(
        envvar=STATE_ENV,  # a URL with a password stays out of the process list
        help="Conversation state: memory, or a Redis URL (redis://host:6379/0) shared by "
        "router replicas.")] = "memory",
    state_timeout: Annotated[float, typer.Option(
        help="Bound (s) on each Redis call; slower means that turn gets no reuse.")] = 0.1,
    engines_file: Annotated[Path | None, typer.Option(
        help="JSON file of engines ({\"prefill\": [...], \"decode\": [...]}), reloaded on "
        "change; joins --prefill/--decode.")] = None,
    prefill_dns: Annotated[list[str] | None, typer.Option(
        help="name:port resolved every --dns-interval; one prefill engine per address "
        "(a headless Service). Repeatable.")] = None,
    decode_dns: Annotated[list[str] | None, typer.Option(
        help="name:port of decode engines, as --prefill-dns. Repeatable.")] = None,
    prefill_kv_port: Annotated[int | None, typer.Option(
        help="Side-channel port of DNS-discovered prefill engines (push).")] = None,
    decode_control_port: Annotated[int | None, typer.Option(
        help="Lease-control port of DNS-discovered decode engines (reuse).")] = None,
    dns_interval: Annotated[float, typer.Option(help="Seconds between DNS lookups.")] = 5.0,
    health_interval: Annotated[float, typer.Option(
        help="Seconds between /health probes of each engine (0: off).")] = 5.0,
    eject_after: Annotated[int, typer.Option(
        help="Consecutive failures that eject an engine until it answers /health.")] = 3,
    drain_timeout: Annotated[float, typer.Option(
        help="On SIGTERM, seconds in-flight requests get to finish.")] = 30.0,
    log_level: str = "info",
) -> None:
    """Run the OpenAI-compatible router in front of prefill and decode engines."""
    from kvferry.router.app import serve
    from kvferry.router.settings import RouterSettings

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    from pydantic import ValidationError

    try:
        settings = RouterSettings(
            prefill_urls=prefill or [], decode_urls=decode or [],
            mode=_choice(mode, ("pull", "push"), "--mode"),  # type: ignore[arg-type]
            prefill_kv_addrs=prefill_kv or [], decode_control_addrs=decode_control or [],
            prefill_engine_ids=prefill_engine_id or [], lease_ttl_s=lease_ttl,
            connect_timeout_s=connect_timeout,
            prefill_timeout_s=prefill_timeout, decode_timeout_s=decode_timeout,
            state=state, state_timeout_s=state_timeout,
            engines_file=str(engines_file) if engines_file else None,
            prefill_dns=prefill_dns or [], decode_dns=decode_dns or [],
            prefill_kv_port=prefill_kv_port, decode_control_port=decode_control_port,
            dns_interval_s=dns_interval,
            health_interval_s=health_interval, eject_after=eject_after,
            drain_timeout_s=drain_timeout,
        )
    except ValidationError as exc:
        msgs = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        raise typer.BadParameter(msgs) from exc
    serve(settings, host=host, port=port, log_level=log_level)


@app.command()
def demo(
    url: str = "http://127.0.0.1:8000",
    turns: Annotated[int, typer.Option(min=1, max=4)] = 4,
    max_tokens: int = 160,
    timeout: float = 120.0,
) -> None:
    """Multi-turn streaming chat through the router; prints per-turn TTFT."""
    raise typer.Exit(run_demo(url, turns=turns, max_tokens=max_tokens, timeout_s=timeout))


def _port_busy(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _up(
    ctx: typer.Context,
    hardware_backend: str,
    model_dir: Path | None,
    prefill_port: int,
    decode_port: int,
    router_port: int,
    connector: str,
    mode: str,
    max_model_len: int,
    engine_arg: list[str],
    ucx_tls: str | None,
    devices_per_engine: int,
    decode_devices: int | None,
    startup_timeout: float,
    run_demo_after: bool,
    demo_max_tokens: int,
    dry_run: bool,
    state: str = "memory",
) -> int:
    """Shared body of `up` and `run`; returns the process exit code."""
    _choice(hardware_backend, BACKENDS, "--hardware-backend")
    _choice(connector, CONNECTORS, "--connector")
    _choice(mode, ("pull", "push"), "--mode")
    if model_dir is None:
        model_dir = STATE_DIR / "models" / "tiny"
        if not dry_run:
            write_model(model_dir, "tiny", weights=True)
    extra = tuple(a for chunk in engine_arg for a in shlex.split(chunk)) + tuple(ctx.args)
    ports = {"prefill": prefill_port, "decode": decode_port}
    logs = STATE_DIR / "logs"
    children: list[Child] = []
    secret = deployment_secret()
    specs: dict[str, EngineSpec] = {}
    # TP per engine (devices, NeuronCores or CPU ranks); D may differ from P. Devices are
    # numbered P first, then D.
    tp = {"prefill": devices_per_engine, "decode": decode_devices or devices_per_engine}
    devices = {"prefill": tuple(range(tp["prefill"])),
               "decode": tuple(range(tp["prefill"], tp["prefill"] + tp["decode"]))}
    for role in ROLES:
        spec = specs[role] = EngineSpec(
            role=role, model=str(model_dir.resolve()), port=ports[role],
            backend=hardware_backend,  # type: ignore[arg-type]
            connector=connector,  # type: ignore[arg-type]
            mode=mode,  # type: ignore[arg-type]
            max_model_len=max_model_len, devices_per_engine=tp[role],
            devices=None if hardware_backend == "cpu" else devices[role],
            ucx_tls=ucx_tls, extra_args=extra,
        )
        children.append(Child(role, engine_argv(spec), logs / f"{role}.log",
                              f"http://127.0.0.1:{ports[role]}/health",
                              {**engine_env(spec), SECRET_ENV: secret}))
    router_url = f"http://127.0.0.1:{router_port}"
    router_argv = [sys.executable, "-m", "kvferry.scripts.cli", "router",
                   "--prefill", f"http://127.0.0.1:{prefill_port}",
                   "--decode", f"http://127.0.0.1:{decode_port}",
                   "--port", str(router_port), "--mode", mode]
    p_spec, d_spec = specs["prefill"], specs["decode"]
    if connector == "kvferry":
        router_argv += ["--prefill-kv", f"{p_spec.host}:{p_spec.side_port}",
                        "--decode-control", f"{d_spec.host}:{d_spec.control_port}"]
    elif mode == "push":  # vLLM's NixlPushConnector: D names P's engine before P answers
        router_argv += ["--prefill-kv", f"{p_spec.host}:{p_spec.side_port}",
                        "--prefill-engine-id", vllm_engine_id(p_spec)]
    router_env = {SECRET_ENV: secret}
    if state != "memory":  # as env: a Redis URL may carry a password (`router --state`)
        router_env[STATE_ENV] = state
    children.append(Child("router", router_argv, logs / "router.log", router_url + "/health",
                          router_env))

    if dry_run:
        for c in children:
            env = [f"{k}={shlex.quote(v)}" for k, v in sorted(c.env.items())]
            typer.echo(f"# {c.name} (log {c.log_path})\n{' '.join([*env, shlex.join(c.argv)])}")
        return 0
    busy = [p for p in (prefill_port, decode_port, router_port) if _port_busy(p)]
    if busy:
        typer.echo(f"port(s) already in use: {busy}; stop what holds them or pick others", err=True)
        return 1

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        for c in children:
            c.start()
            typer.echo(f"started {c.name} (pid {c.proc.pid if c.proc else '?'}, log {c.log_path})")
        t0 = time.monotonic()
        wait_healthy(children, startup_timeout, on_ready=lambda c: typer.echo(
            f"{c.name} healthy after {time.monotonic() - t0:.0f}s"))
        typer.echo(f"prefill  http://127.0.0.1:{prefill_port}\n"
                   f"decode   http://127.0.0.1:{decode_port}\n"
                   f"router   {router_url}  (OpenAI API: {router_url}/v1)")
        if run_demo_after:
            rc = run_demo(router_url, max_tokens=demo_max_tokens)
            dead = first_dead(children)
            if dead is not None:
                typer.echo(died_message(dead), err=True)
                rc = rc or 1
            return rc
        typer.echo("running; Ctrl-C to stop")
        while True:
            dead = first_dead(children)
            if dead is not None:
                typer.echo(died_message(dead), err=True)
                return 1
            time.sleep(1)
    except StartupError as exc:
        typer.echo(f"startup failed: {exc}", err=True)
        return 1
    except (KeyboardInterrupt, Shutdown) as exc:
        typer.echo(f"stopping ({type(exc).__name__} {exc})".strip(), err=True)
        return 130 if isinstance(exc, KeyboardInterrupt) else 143
    finally:
        # Ignore further signals while stopping so a second Ctrl-C cannot leave orphans.
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        stop_all(children)
        for s, handler in old.items():
            signal.signal(s, handler)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        typer.echo("all processes stopped", err=True)


BackendOpt = Annotated[str, typer.Option(help="cpu | cuda | neuron.")]
ModelOpt = Annotated[Path | None, typer.Option(
    "--model", help="Model dir (default: generate tiny into ./.kvferry/models/tiny).")]
ConnectorOpt = Annotated[str, typer.Option(help="kvferry | vllm-nixl.")]
ModeOpt = Annotated[str, typer.Option(help="pull | push.")]
EngineArgOpt = Annotated[list[str] | None, typer.Option(
    help="Extra engine args (shell-split, repeatable); args after `--` are passed too.")]
UcxOpt = Annotated[str | None, typer.Option(help="Set UCX_TLS for the engines.")]
DecodeDevicesOpt = Annotated[int | None, typer.Option(
    help="TP size of the decode engine when it differs from the prefill's "
         "(--devices-per-engine); KV moves by head segments between the two.")]


@app.command(context_settings=EXTRA)
def up(
    ctx: typer.Context,
    hardware_backend: BackendOpt = "cpu",
    model_dir: ModelOpt = None,
    prefill_port: int = 8100,
    decode_port: int = 8200,
    router_port: int = 8000,
    connector: ConnectorOpt = "kvferry",
    mode: ModeOpt = "pull",
    max_model_len: int = 4096,
    engine_arg: EngineArgOpt = None,
    ucx_tls: UcxOpt = None,
    devices_per_engine: int = 1,
    decode_devices: DecodeDevicesOpt = None,
    startup_timeout: float = 900.0,
    demo: Annotated[bool, typer.Option("--demo", help="Run the demo, then stop.")] = False,
    demo_max_tokens: int = 160,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print commands only.")] = False,
    state: Annotated[str, typer.Option(
        help="The router's conversation state: memory, or a Redis URL (redis://host:6379/0) "
        "that other router replicas share.")] = "memory",
) -> None:
    """Start 1 prefill + 1 decode vLLM engine and the router; Ctrl-C stops all."""
    raise typer.Exit(_up(ctx, hardware_backend, model_dir, prefill_port, decode_port,
                         router_port, connector, mode, max_model_len, engine_arg or [],
                         ucx_tls, devices_per_engine, decode_devices, startup_timeout, demo,
                         demo_max_tokens, dry_run, state))


@app.command(context_settings=EXTRA)
def run(
    ctx: typer.Context,
    hardware_backend: BackendOpt = "cpu",
    model_dir: ModelOpt = None,
    prefill_port: int = 8100,
    decode_port: int = 8200,
    router_port: int = 8000,
    connector: ConnectorOpt = "kvferry",
    mode: ModeOpt = "pull",
    max_model_len: int = 4096,
    engine_arg: EngineArgOpt = None,
    ucx_tls: UcxOpt = None,
    devices_per_engine: int = 1,
    decode_devices: DecodeDevicesOpt = None,
    startup_timeout: float = 900.0,
    demo_max_tokens: int = 160,
) -> None:
    """`up --demo`: start everything, run the demo, stop; exit code is the demo's."""
    raise typer.Exit(_up(ctx, hardware_backend, model_dir, prefill_port, decode_port,
                         router_port, connector, mode, max_model_len, engine_arg or [],
                         ucx_tls, devices_per_engine, decode_devices, startup_timeout, True,
                         demo_max_tokens, False))


def main() -> None:
    """Console entry point (`kvferry`)."""
    app()


if __name__ == "__main__":
    main()
