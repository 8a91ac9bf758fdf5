"""`kvferry bench`'s command line: options -> BenchConfig, --dry-run's plan, the run."""

from __future__ import annotations

import asyncio
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from .bench import DEFAULT_NUM_REQUESTS, BenchConfig, git_commit, run_bench
from .bench_core import parse_target, split_list
from .engines import ROUTER_PORT


def bench(
    target: Annotated[list[str] | None, typer.Option(
        help="URL or NAME=URL,impl=..,mode=..,model=..,x-header=value (all but URL optional); "
        "repeat for side by side.")] = None,
    input_len: Annotated[list[str] | None, typer.Option(
        help="Prompt length(s) in tokens, comma list (multi-turn: first turn).")] = None,
    output_len: Annotated[int, typer.Option(min=1, help="Tokens generated per request.")] = 128,
    qps: Annotated[list[str] | None, typer.Option(
        help="Offered rate(s), comma list; 0 = one request (conversation) at a time.")] = None,
    arrival: Annotated[str, typer.Option(help="poisson | fixed.")] = "poisson",
    seed: int = 0,
    num_requests: Annotated[int | None, typer.Option(
        min=1, help=f"Requests (conversations) per point (default {DEFAULT_NUM_REQUESTS} "
        "unless --duration).")] = None,
    duration: Annotated[float | None, typer.Option(
        min=0.001, help="Seconds of arrivals per point (with --num-requests: both bound).")] = None,
    vocab: Annotated[int, typer.Option(
        help="Token ids are drawn from [10, vocab); set the model's vocab_size.")] = 1000,
    prefix_len: Annotated[int, typer.Option(min=0, help="Shared prompt prefix (tokens).")] = 0,
    turns: Annotated[int, typer.Option(min=1, help="Turns per conversation (multi-turn).")] = 1,
    turn_growth: Annotated[int, typer.Option(min=0, help="New tokens added each turn.")] = 256,
    think_time: Annotated[float, typer.Option(min=0, help="Seconds between turns.")] = 0.0,
    request_timeout: Annotated[float, typer.Option(min=0.001, help="Per-request limit (s).")] = 300.0,
    same_prompts: Annotated[bool, typer.Option(
        "--same-prompts", help="Identical prompts for every target (default: per target).")] = False,
    warmup: Annotated[int, typer.Option(min=0, help="Unrecorded requests per target first.")] = 1,
    served_model: Annotated[str | None, typer.Option(
        help="`model` in the body (default: first of the target's /v1/models).")] = None,
    impl: Annotated[str, typer.Option(help="Default impl for targets without impl=.")] = "kvferry",
    mode: Annotated[str, typer.Option(help="Default mode for targets without mode=.")] = "pull",
    experiment: Annotated[str | None, typer.Option(
        help="Experiment name (default push_vs_pull; bidirectional with --turns > 1).")] = None,
    hardware: Annotated[str, typer.Option(help="Hardware tag, e.g. h200x2, cpu, trn2.")] = "cpu",
    model_name: Annotated[str, typer.Option(help="Model tag for the results, e.g. qwen3-32b.")] = "tiny",
    results_dir: Annotated[Path, typer.Option(help="Where the JSONL goes.")] = Path("benchmarks/results"),
    raw: Annotated[Path | None, typer.Option(help="Also append per-request records here.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a TTFT-vs-QPS PNG here.")] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan only.")] = False,
) -> None:
    """Open-loop TTFT/TPOT/handoff benchmark of running stacks (router or engine URLs)."""
    try:
        targets = [parse_target(s, impl, mode) for s in (target or [f"http://127.0.0.1:{ROUTER_PORT}"])]
        lens = split_list(input_len or ["1024"], int)
        rates = split_list(qps or ["1"], float)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if arrival not in ("poisson", "fixed"):
        raise typer.BadParameter(f"{arrival!r} not in poisson, fixed", param_hint="--arrival")
    if len({t.name for t in targets}) != len(targets):
        raise typer.BadParameter("target names must be unique", param_hint="--target")
    if any(n < 1 for n in lens) or any(q < 0 for q in rates):
        raise typer.BadParameter("input lengths must be >= 1 and rates >= 0")
    commit, dirty = git_commit()
    cfg = BenchConfig(
        targets=targets, input_lens=lens, qps_list=rates, output_len=output_len, arrival=arrival,
        seed=seed, num_requests=num_requests, duration_s=duration, vocab=vocab,
        prefix_len=prefix_len, turns=turns, turn_growth=turn_growth, think_time_s=think_time,
        request_timeout_s=request_timeout, same_prompts=same_prompts, warmup=warmup,
        served_model=served_model,
        experiment=experiment or ("bidirectional" if turns > 1 else "push_vs_pull"),
        hardware=hardware, model_name=model_name, results_dir=results_dir, raw_path=raw,
        plot_path=plot, progress=progress, command=shlex.join(sys.argv), commit=commit,
        commit_dirty=dirty,
    )
    if dry_run:
        for t in targets:
            typer.echo(f"target {t.name}: {t.url} impl={t.impl} mode={t.mode}"
                       + (f" headers={dict(t.headers)}" if t.headers else ""))
        for q in rates:
            n = cfg.planned(q)
            typer.echo(f"qps {q:g}: {'?' if n is None else n} conversation(s) x {turns} turn(s) "
                       f"per (target, input_len in {lens})")
        typer.echo(f"results -> {cfg.out_path}")
        return
    try:
        lines = asyncio.run(run_bench(cfg))
    except RuntimeError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"{len(lines)} line(s) appended to {cfg.out_path}")
    if plot:
        typer.echo(f"plot: {plot}")
    if any(line["n"] == 0 for line in lines):
        typer.echo("some points had no successful request (see errors / error_samples)", err=True)
        raise typer.Exit(1)
