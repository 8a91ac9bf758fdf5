"""`kvferry` command line: model, router, up, run, demo.

`kvferry run` (= `kvferry up --demo`) is the one-liner: generate the tiny model, start one
prefill engine, one decode engine and the router, wait for all /health, run the demo
conversation, stop everything (process groups, no orphans) and exit with the demo's code.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Annotated

import typer

from .bench_cli import bench
from .capacity_cli import plan_command
from .chaos import chaos
from .demo import run_demo
from .engines import HTTP_PORT, ROUTER_PORT
from .launch import launch_app
from .modelgen import SHAPES, write_model
from .soak import soak
from .up_stack import DECODE_HTTP_PORT, STATE_ENV, choice, up_stack

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="kvferry: prefill/decode disaggregated serving on vLLM.")

app.add_typer(launch_app, name="launch")
app.command(name="bench")(bench)
app.command(name="chaos")(chaos)
app.command(name="soak")(soak)
app.command(name="plan")(plan_command)

EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}


@app.command()
def model(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the model into.")],
    shape: Annotated[str, typer.Option(help=f"One of: {', '.join(SHAPES)}.")] = "tiny",
    weights: Annotated[bool, typer.Option(
        help="Also write deterministic random weights (small shapes).")] = False,
) -> None:
    """Write a model dir (config + locally trained tokenizer [+ generated weights])."""
    choice(shape, tuple(SHAPES), "--shape")
    typer.echo(str(write_model(out_dir, shape, weights)))


def wire_router_faults() -> None:
    """In a chaos run's router ($KVFERRY_FAULTS names a fault plan) its lease-control calls
    meet the plan's ``lease_call`` point; the router may not import the connectors' fault
    hooks itself (pyproject.toml's contracts), so the process that starts it does."""
    from kvferry.connectors.transfer import faults

    if faults.ACTIVE:
        from kvferry.router.conversations import lease_control

        lease_control.fault_hook = functools.partial(faults.lost_async, "lease_call")


@app.command()
def router(
    prefill: Annotated[list[str] | None, typer.Option(
        help="Prefill engine URL (repeat or comma-list).")] = None,
    decode: Annotated[list[str] | None, typer.Option(
        help="Decode engine URL (repeat or comma-list).")] = None,
    host: str = "127.0.0.1",
    port: int = ROUTER_PORT,
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
        help="Conversation state: memory, a Redis URL (redis://host:6379/0) shared by "
        "router replicas, or sqlite:///path shared by one host's router processes.")] = "memory",
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
    workers: Annotated[int, typer.Option(
        envvar="KVFERRY_ROUTER_WORKERS", help="Router processes on the port (SO_REUSEPORT), "
        "one core each; they share conversations through --state, or, with memory, a SQLite "
        "file on tmpfs.")] = 1,
    max_active: Annotated[int, typer.Option(
        envvar="KVFERRY_MAX_ACTIVE", help="Completions served at once (streams count until "
        "their end); more wait for admission.")] = 512,
    max_queued: Annotated[int, typer.Option(
        envvar="KVFERRY_MAX_QUEUED", help="Requests that may wait for admission; more get 429 "
        "with Retry-After.")] = 1024,
    queue_timeout: Annotated[float, typer.Option(
        envvar="KVFERRY_QUEUE_TIMEOUT", help="Seconds a request may wait for admission; then "
        "503 with Retry-After.")] = 10.0,
    max_migrations: Annotated[int, typer.Option(
        envvar="KVFERRY_MAX_MIGRATIONS", help="Engine pairs a stream may move to after its "
        "decode engine broke mid-stream (0: the stream ends with an SSE error event).")] = 2,
    d_local_max_new_tokens: Annotated[int, typer.Option(
        envvar="KVFERRY_D_LOCAL_MAX_NEW_TOKENS", help="Turns with at most this many new tokens "
        "are served by the conversation's decode engine from its cache, without P (0: off).")] = 1024,
    d_local_busy_tokens_per_s: Annotated[float, typer.Option(
        envvar="KVFERRY_D_LOCAL_BUSY_TOKENS_PER_S", help="D-local prefill tokens/s a decode "
        "engine with other requests in flight may take (0: only an idle one).")] = 1200.0,
    d_local_max_in_flight: Annotated[int, typer.Option(
        envvar="KVFERRY_D_LOCAL_MAX_IN_FLIGHT", help="No D-local turn for a decode engine with "
        "this many requests open from this router.")] = 32,
    prefill_kv_events: Annotated[list[str] | None, typer.Option(
        help="vLLM KV cache event endpoint (tcp://host:port, the engine's --kv-events-config) "
        "of each prefill engine, same order as --prefill: token-id prompts go to the P "
        "holding most of their prefix, weighed with load.")] = None,
    content_reuse: Annotated[bool, typer.Option(
        envvar="KVFERRY_CONTENT_REUSE", help="Recognise chat conversations sent without an id "
        "by their content (per API key).")] = True,
    first_token_from_prefill: Annotated[bool, typer.Option(
        envvar="KVFERRY_FIRST_TOKEN_FROM_PREFILL", help="Push, greedy streams: the client "
        "gets P's first token as soon as P answers (D's own token 1 is checked and dropped).")] = True,
    first_token_chat: Annotated[bool, typer.Option(
        envvar="KVFERRY_FIRST_TOKEN_CHAT", help="Also for chat streams: only where the engines "
        "run no reasoning parser.")] = False,
    api_keys_file: Annotated[Path | None, typer.Option(
        envvar="KVFERRY_API_KEYS_FILE", help='JSON file {"key id": "key", ...} of router API '
        "keys, re-read when it changes: requests without a listed key get 401, tenants are "
        "key ids.")] = None,
    operator_token_file: Annotated[Path | None, typer.Option(
        envvar="KVFERRY_OPERATOR_TOKEN_FILE", help="File holding the operator token (else "
        "$KVFERRY_OPERATOR_TOKEN): requests with header x-kvferry-operator-token see which "
        "engines served them, /health's engine list and ?deep=true.")] = None,
    max_body_bytes: Annotated[int | None, typer.Option(
        envvar="KVFERRY_MAX_BODY_BYTES", help="Larger request bodies get 413 unread (default: "
        "sized for the engines' max_model_len).")] = None,
    log_level: str = "info",
) -> None:
    """Run the OpenAI-compatible router in front of prefill and decode engines."""
    from kvferry.router.api import workers as router_workers
    from kvferry.router.settings import RouterSettings

    wire_router_faults()
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    from pydantic import ValidationError

    try:
        settings = RouterSettings(
            prefill_urls=prefill or [], decode_urls=decode or [],
            mode=choice(mode, ("pull", "push"), "--mode"),  # type: ignore[arg-type]
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
            drain_timeout_s=drain_timeout, max_migrations=max_migrations,
            max_active=max_active, max_queued=max_queued, queue_timeout_s=queue_timeout,
            d_local_max_new_tokens=d_local_max_new_tokens,
            d_local_busy_tokens_per_s=d_local_busy_tokens_per_s,
            d_local_max_in_flight=d_local_max_in_flight, content_reuse=content_reuse,
            prefill_kv_events=prefill_kv_events or [],
            first_token_from_prefill=first_token_from_prefill, first_token_chat=first_token_chat,
            api_keys_file=str(api_keys_file) if api_keys_file else None,
            operator_token_file=str(operator_token_file) if operator_token_file else None,
            max_body_bytes=max_body_bytes,
        )
    except ValidationError as exc:
        msgs = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        raise typer.BadParameter(msgs) from exc
    if (why := router_workers.check(settings, workers)) is not None:
        raise typer.BadParameter(why)
    raise typer.Exit(router_workers.serve_workers(settings, host, port, log_level, workers))


@app.command()
def demo(
    url: str = f"http://127.0.0.1:{ROUTER_PORT}",
    turns: Annotated[int, typer.Option(min=1, max=4)] = 4,
    max_tokens: int = 160,
    timeout: float = 120.0,
) -> None:
    """Multi-turn streaming chat through the router; prints per-turn TTFT."""
    raise typer.Exit(run_demo(url, turns=turns, max_tokens=max_tokens, timeout_s=timeout))


BackendOpt = Annotated[str, typer.Option(help="cpu | cuda | neuron.")]
ModelOpt = Annotated[str | None, typer.Option(
    "--model", help="Model dir, or a Hugging Face id (org/name) that vLLM downloads "
    "(default: generate tiny into ./.kvferry/models/tiny).")]
ConnectorOpt = Annotated[str, typer.Option(help="kvferry | vllm-nixl.")]
ModeOpt = Annotated[str, typer.Option(help="pull | push.")]
EngineArgOpt = Annotated[list[str] | None, typer.Option(
    help="Extra engine args (shell-split, repeatable); args after `--` are passed too.")]
UcxOpt = Annotated[str | None, typer.Option(help="Set UCX_TLS for the engines.")]
NixlOpt = Annotated[list[str] | None, typer.Option(
    help="NIXL backend(s) of the kvferry connector (default: the memory backend's choice).")]
ShareDeviceOpt = Annotated[float | None, typer.Option(
    "--share-device", metavar="KV_GIB",
    help="CUDA: run P and D on the same GPU(s), each with this many GiB of KV cache "
         "(one GPU lent; transfers between them stay on the device).")]
DecodeDevicesOpt = Annotated[int | None, typer.Option(
    help="TP size of the decode engine when it differs from the prefill's "
         "(--devices-per-engine); KV moves by head segments between the two.")]


@app.command(context_settings=EXTRA)
def up(
    ctx: typer.Context,
    hardware_backend: BackendOpt = "cpu",
    model_dir: ModelOpt = None,
    prefill_port: int = HTTP_PORT,
    decode_port: int = DECODE_HTTP_PORT,
    router_port: int = ROUTER_PORT,
    connector: ConnectorOpt = "kvferry",
    mode: ModeOpt = "pull",
    max_model_len: int = 4096,
    engine_arg: EngineArgOpt = None,
    ucx_tls: UcxOpt = None,
    nixl_backend: NixlOpt = None,
    devices_per_engine: int = 1,
    decode_devices: DecodeDevicesOpt = None,
    share_device: ShareDeviceOpt = None,
    startup_timeout: float = 900.0,
    demo: Annotated[bool, typer.Option("--demo", help="Run the demo, then stop.")] = False,
    demo_max_tokens: int = 160,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print commands only.")] = False,
    state: Annotated[str, typer.Option(
        help="The router's conversation state: memory, or a Redis URL (redis://host:6379/0) "
        "that other router replicas share.")] = "memory",
    kv_checksums: Annotated[str | None, typer.Option(
        help="off | sample | all: compare the checksums of transferred KV blocks (READs, push "
        "WRITEs) with the "
        "source's (sample: 5% of requests, the connector's default).")] = None,
    router_workers: Annotated[int, typer.Option(
        min=1, help="Router processes (one core each); they share conversations without "
        "Redis.")] = 1,
) -> None:
    """Start 1 prefill + 1 decode vLLM engine and the router; Ctrl-C stops all."""
    raise typer.Exit(up_stack(
        ctx.args, hardware_backend=hardware_backend, model_dir=model_dir,
        prefill_port=prefill_port, decode_port=decode_port, router_port=router_port,
        connector=connector, mode=mode, max_model_len=max_model_len,
        engine_arg=engine_arg or [], ucx_tls=ucx_tls, nixl_backends=nixl_backend,
        devices_per_engine=devices_per_engine, decode_devices=decode_devices,
        startup_timeout=startup_timeout, run_demo_after=demo, demo_max_tokens=demo_max_tokens,
        dry_run=dry_run, state=state, share_device_gib=share_device, kv_checksums=kv_checksums,
        router_workers=router_workers))


# `run` repeats most of `up`'s parameters on purpose: typer reads a command's options from
# its own signature, and `run` (the README's one-command quick start) is `up --demo` with
# the options a demo run needs; its body only forwards them to the same `up_stack`.
@app.command(context_settings=EXTRA)
def run(
    ctx: typer.Context,
    hardware_backend: BackendOpt = "cpu",
    model_dir: ModelOpt = None,
    prefill_port: int = HTTP_PORT,
    decode_port: int = DECODE_HTTP_PORT,
    router_port: int = ROUTER_PORT,
    connector: ConnectorOpt = "kvferry",
    mode: ModeOpt = "pull",
    max_model_len: int = 4096,
    engine_arg: EngineArgOpt = None,
    ucx_tls: UcxOpt = None,
    devices_per_engine: int = 1,
    decode_devices: DecodeDevicesOpt = None,
    share_device: ShareDeviceOpt = None,
    startup_timeout: float = 900.0,
    demo_max_tokens: int = 160,
) -> None:
    """`up --demo`: start everything, run the demo, stop; exit code is the demo's."""
    raise typer.Exit(up_stack(
        ctx.args, hardware_backend=hardware_backend, model_dir=model_dir,
        prefill_port=prefill_port, decode_port=decode_port, router_port=router_port,
        connector=connector, mode=mode, max_model_len=max_model_len,
        engine_arg=engine_arg or [], ucx_tls=ucx_tls, devices_per_engine=devices_per_engine,
        decode_devices=decode_devices, startup_timeout=startup_timeout, run_demo_after=True,
        demo_max_tokens=demo_max_tokens, dry_run=False, share_device_gib=share_device))


def main() -> None:
    """Console entry point (`kvferry`)."""
    app()


if __name__ == "__main__":
    main()
