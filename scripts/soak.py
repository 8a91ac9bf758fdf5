"""`kvferry soak`: the chaos stack (2P2D real engines + router) under seeded mixed traffic
and faults for an hour or more, on one stack that is never restarted as a whole, with the
books drawn every segment (10 minutes by default).

Each segment: three clients send pull, push, conversation (D->P reuse, D-local turns) and
single requests, every answer compared with its colocated greedy reference, while the
chaos injector goes through its faults (engine and router kills and restarts, dropped
NIXL notifications and posts, so agents are recreated, lease-control faults, held READs,
leases released mid-read, forged params, flipped KV bytes) one every ``--fault-every``
seconds. Then every conversation ends and the KV must settle to its baseline. One result
line per segment (``experiment: "soak"``): cumulative requests, wrong outputs, hangs,
checksum mismatches against corruptions injected, blocks not freed, and the resident
memory of every process (engines with their engine-core and worker children), so growth
over the hour shows. A benchmark, not a CI test: it takes both cores for the whole run.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from datetime import date
from pathlib import Path
from typing import Annotated, Any

import typer

from .chaos import Books, commit, segment, start
from .chaos_stack import ChaosStack
from .procs import stop_on_signals


def rss_mb(stack: ChaosStack) -> dict[str, float]:
    """Resident memory of each process of the stack, children included (an engine's API
    server, engine core and workers), in MB."""
    import psutil

    out: dict[str, float] = {}
    for p in stack.procs:
        pid = p.pid()
        if pid is None:
            continue
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
            out[p.name] = round(sum(q.memory_info().rss for q in procs) / 2**20, 1)
        except psutil.Error:
            continue
    return out


def segment_line(k: int, b: Books, totals: Counter, elapsed_s: float, rss: dict[str, float],
                 head: dict[str, Any]) -> dict[str, Any]:
    """The result line after segment ``k`` (counts cumulative since the soak started)."""
    return {**head, "segment": k, "elapsed_s": round(elapsed_s),
            "requests": totals["requests"], "requests_segment": len(b.outcomes),
            "ok": totals["ok"], "errors": totals["error"],
            "wrong_outputs": totals["wrong"], "hangs": totals["hang"],
            "faults_injected": totals["faults"],
            "checksum_mismatches": b.corruptions_caught,
            "corruptions_injected": b.corruptions_injected,
            "leaked_blocks": sum(v for v in b.leaked.values() if v == v) if b.leaked else 0,
            "crashes": len(b.crashes), "rss_mb": rss,
            "violations": b.violations}


def soak(
    duration: Annotated[float, typer.Option(help="Seconds of traffic in all.")] = 3600.0,
    every: Annotated[float, typer.Option(help="Seconds per segment (a result line each).")] = 600.0,
    fault_every: Annotated[float, typer.Option(help="Seconds between two faults.")] = 30.0,
    seed: Annotated[int, typer.Option(help="Seeds the traffic, the faults and the hooks.")] = 1,
    workers: Annotated[int, typer.Option(help="Concurrent clients.")] = 3,
    logs: Annotated[Path, typer.Option(help="Engine/router logs and the fault plan.")] = Path(
        ".kvferry/soak"),
    results: Annotated[Path, typer.Option(help="Directory for soak-cpu-<date>.jsonl.")] = Path(
        "benchmarks/results"),
) -> None:
    """Real 2P2D engines + router under traffic and faults for ``duration`` seconds; one
    result line per segment; exits 1 if any segment broke an invariant."""
    with stop_on_signals():  # SIGTERM/SIGINT: the `finally` below stops every engine
        _soak(duration, every, fault_every, seed, workers, logs, results)


def _soak(duration: float, every: float, fault_every: float, seed: int, workers: int, logs: Path,
          results: Path) -> None:
    command = " ".join(["kvferry", *sys.argv[1:]])
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"soak-cpu-{date.today().strftime('%Y%m%d')}.jsonl"
    s = start(seed, logs, echo=typer.echo)
    head = {"experiment": "soak", "impl": "kvferry", "hardware": "cpu", "model": "tiny",
            "mode": "mixed", "seed": seed, "workers": workers, "segment_s": every,
            "fault_every_s": fault_every, "checksums": s.stack.extra["kv_checksums"],
            "command": command, "commit": commit(), "date": date.today().isoformat()}
    totals: Counter = Counter()
    failed = False
    t0 = time.monotonic()
    try:
        line = {**head, "segment": 0, "elapsed_s": 0, "rss_mb": rss_mb(s.stack)}
        with path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        for k in range(1, max(1, round(duration / every)) + 1):
            b, inj, _ = segment(s, every, workers, seed * 1000 + k, fault_every)
            totals.update(o.kind for o in b.outcomes)
            totals["requests"] += len(b.outcomes)
            totals["faults"] += len(inj.events)
            line = segment_line(k, b, totals, time.monotonic() - t0, rss_mb(s.stack), head)
            with path.open("a") as f:
                f.write(json.dumps(line) + "\n")
            typer.echo(json.dumps({k: line[k] for k in (
                "segment", "elapsed_s", "requests", "wrong_outputs", "hangs",
                "checksum_mismatches", "corruptions_injected", "leaked_blocks", "rss_mb")}))
            failed = failed or bool(b.violations)
            for v in b.violations:
                typer.echo(f"VIOLATION (segment {k}) {v}")
    finally:
        s.client.close()
        s.stack.stop()
    typer.echo(f"results: {path}")
    raise typer.Exit(1 if failed else 0)
