"""`kvferry up` / `kvferry run`: one prefill engine, one decode engine and the router on
this machine, their command lines from the one engine builder (engines.py), supervised as
process groups (no orphans) until SIGINT (Ctrl-C, or `kill -INT` of an `up` started with
`&`, which a shell starts with SIGINT ignored), SIGTERM, SIGHUP, a death, or the demo's end."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import typer

from kvferry.connectors.protocol.params import SECRET_ENV, deployment_secret
from kvferry.router.wire.headers import OPERATOR_TOKEN_ENV

from .cpu_pin import restore_worker_binding
from .demo import run_demo
from .engines import (
    BACKENDS,
    CONNECTORS,
    ROLES,
    SIDE_CHANNEL_PORT,
    EngineSpec,
    engine_argv,
    engine_env,
    shared_device_args,
    vllm_engine_id,
)
from .modelgen import write_model
from .procs import (
    STOP_SIGNALS,
    Child,
    Shutdown,
    StartupError,
    died_message,
    first_dead,
    on_stop_signal,
    stop_all,
    wait_healthy,
)

STATE_ENV = "KVFERRY_STATE_URL"
"""Where `kvferry router` (and so `kvferry up`) takes `--state` from when it is not given."""
STATE_DIR = Path(".kvferry")
DECODE_HTTP_PORT = 8200


class ModelNotFound(ValueError):
    """--model names neither a local model directory nor a Hugging Face model id."""


def engine_model(model: str | None, dry_run: bool) -> str:
    """--model as the engines get it: an existing local directory, resolved (absolute: the
    engines' own cwd does not matter); a Hugging Face id (``org/name``) that is no local
    path, unchanged (vLLM downloads it on a connected host); nothing: the generated tiny
    model. Anything else is refused in one line before a process starts."""
    if model is None:
        path = STATE_DIR / "models" / "tiny"
        if not dry_run:
            write_model(path, "tiny", weights=True)
        return str(path.resolve())
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if path.exists():
        raise ModelNotFound(f"--model {model}: not a directory (give the model's directory "
                            "or a Hugging Face id)")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        raise ModelNotFound(f"--model {model}: no such directory, and not a Hugging Face "
                            "model id (org/name)") from None
    return model



def _transfers(specs: dict[str, EngineSpec]) -> str:
    """What each kvferry engine moved, from its side channel's counters (one JSON line)."""
    from kvferry.connectors.transfer.handshake import HandshakeError, fetch_engine_stats

    out: dict[str, dict[str, object]] = {}
    for role, spec in specs.items():
        try:
            s = fetch_engine_stats(spec.side_host, spec.side_port, spec.devices_per_engine)
            out[role] = {k: v for k, v in s.counters.items() if v}
        except HandshakeError as e:
            out[role] = {"unavailable": str(e)}
    return "transfers " + json.dumps(out, sort_keys=True)

def choice(value: str, allowed: tuple[str, ...], flag: str) -> str:
    if value not in allowed:
        raise typer.BadParameter(f"{value!r} not in {', '.join(allowed)}", param_hint=flag)
    return value


def _port_busy(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def up_engines(model: str, hardware_backend: str, ports: dict[str, int], tp: dict[str, int], *,
               connector: str = "kvferry", mode: str = "pull", max_model_len: int | None = 4096,
               ucx_tls: str | None = None, nixl_backends: list[str] | None = None,
               extra: tuple[str, ...] = (), share_device_gib: float | None = None,
               connector_extra: dict[str, Any] | None = None) -> dict[str, EngineSpec]:
    """`up`'s two engines on this host, P then D: devices numbered P first, D's side-channel
    ports after P's ranks and lease control (the one port layout: engines.py).

    ``share_device_gib`` (CUDA): P and D on the same GPUs, each with that much KV cache."""
    specs: dict[str, EngineSpec] = {}
    side, first = SIDE_CHANNEL_PORT, 0
    if share_device_gib is not None:
        extra = extra + shared_device_args(share_device_gib)
    for role in ROLES:
        spec = specs[role] = EngineSpec(
            role=role, model=model, port=ports[role],
            backend=hardware_backend,  # type: ignore[arg-type]
            connector=connector,  # type: ignore[arg-type]
            mode=mode,  # type: ignore[arg-type]
            max_model_len=max_model_len, devices_per_engine=tp[role], side_channel_port=side,
            devices=None if hardware_backend == "cpu" else tuple(range(first, first + tp[role])),
            ucx_tls=ucx_tls, nixl_backends=tuple(nixl_backends or ()), extra_args=extra,
            connector_extra=dict(connector_extra or {}),
        )
        side = spec.next_side_channel_port
        first = 0 if share_device_gib is not None else first + tp[role]
    return specs


def up_stack(
    extra_args: list[str],
    *,
    hardware_backend: str,
    model_dir: str | None,
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
    nixl_backends: list[str] | None = None,
    share_device_gib: float | None = None,
    kv_checksums: str | None = None,
    router_workers: int = 1,
) -> int:
    """`up` and `run`: start (or with ``dry_run`` print) the stack; the exit code."""
    choice(hardware_backend, BACKENDS, "--hardware-backend")
    choice(connector, CONNECTORS, "--connector")
    choice(mode, ("pull", "push"), "--mode")
    if kv_checksums is not None:
        choice(kv_checksums, ("off", "sample", "all"), "--kv-checksums")
        if connector != "kvferry":
            typer.echo("--kv-checksums is a setting of kvferry's connector", err=True)
            return 2
    if share_device_gib is not None and hardware_backend != "cuda":
        typer.echo("--share-device puts P and D on the same GPU: it needs --hardware-backend "
                   "cuda (NeuronCores and CPU cores are not shared)", err=True)
        return 2
    try:
        model = engine_model(model_dir, dry_run)
    except ModelNotFound as exc:
        typer.echo(f"error: {exc}", err=True)
        return 2
    extra = tuple(a for chunk in engine_arg for a in shlex.split(chunk)) + tuple(extra_args)
    ports = {"prefill": prefill_port, "decode": decode_port}
    logs = STATE_DIR / "logs"
    children: list[Child] = []
    secret = deployment_secret()
    # TP per engine (devices, NeuronCores or CPU ranks); D may differ from P.
    tp = {"prefill": devices_per_engine, "decode": decode_devices or devices_per_engine}
    specs = up_engines(model, hardware_backend, ports, tp, connector=connector,
                       mode=mode, max_model_len=max_model_len, ucx_tls=ucx_tls,
                       nixl_backends=nixl_backends or [], extra=extra,
                       share_device_gib=share_device_gib,
                       connector_extra={"kv_checksums": kv_checksums} if kv_checksums else None)
    for role, spec in specs.items():
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
        router_argv += ["--prefill-kv", f"{p_spec.side_host}:{p_spec.side_port}",
                        "--decode-control", f"{d_spec.side_host}:{d_spec.control_port}"]
    elif mode == "push":  # vLLM's NixlPushConnector: D names P's engine before P answers
        router_argv += ["--prefill-kv", f"{p_spec.side_host}:{p_spec.side_port}",
                        "--prefill-engine-id", vllm_engine_id(p_spec)]
    if router_workers > 1:  # they share conversations (Redis, or a SQLite file on tmpfs)
        router_argv += ["--workers", str(router_workers)]
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

    if run_demo_after and not os.environ.get(OPERATOR_TOKEN_ENV):
        # The demo prints which engines served each turn, which the router shows only to
        # its operator: a token for this stack alone, known to the router and the demo.
        os.environ[OPERATOR_TOKEN_ENV] = secrets.token_hex(16)
    old = {s: signal.signal(s, on_stop_signal) for s in STOP_SIGNALS}
    try:
        for c in children:
            c.start()
            typer.echo(f"started {c.name} (pid {c.proc.pid if c.proc else '?'}, log {c.log_path})")
        t0 = time.monotonic()
        wait_healthy(children, startup_timeout, on_ready=lambda c: typer.echo(
            f"{c.name} healthy after {time.monotonic() - t0:.0f}s"))
        if connector == "vllm-nixl" and hardware_backend == "cpu":
            for c in children[:2]:  # vLLM's NIXL worker moved its forward to the last core
                for pid, was in restore_worker_binding(c).items():
                    typer.echo(f"{c.name}: worker {pid} re-bound from cores {sorted(was)} to "
                               f"{c.env['VLLM_CPU_OMP_THREADS_BIND']} (scripts/cpu_pin.py)")
        typer.echo(f"prefill  http://127.0.0.1:{prefill_port}\n"
                   f"decode   http://127.0.0.1:{decode_port}\n"
                   f"router   {router_url}  (OpenAI API: {router_url}/v1)")
        if run_demo_after:
            rc = run_demo(router_url, max_tokens=demo_max_tokens)
            if connector == "kvferry":
                typer.echo(_transfers(specs))
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
        name = str(exc) if isinstance(exc, Shutdown) else "SIGINT"
        typer.echo(f"stopping ({name})", err=True)
        return 128 + signal.Signals[name].value
    finally:
        # Ignore further signals while stopping so a second Ctrl-C cannot leave orphans.
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        stop_all(children)
        for s, handler in old.items():
            signal.signal(s, handler)
        typer.echo("all processes stopped", err=True)


