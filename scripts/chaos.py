"""`kvferry chaos`: a 2P2D stack of real engines behind the router under mixed traffic
while a seeded injector kills, restarts, drops, delays, forges and oversizes
(chaos_faults.py); then the books.

The books (each one an invariant the run fails on):
- every request equals its colocated greedy reference or ended with a clear error (an
  HTTP error with an error body, or an SSE error event); a refused or broken connection
  only from a process that was being killed (the router answers for its engines);
- none took longer than `chaos_traffic.HANG_S` (no hang);
- every engine's KV usage (vLLM's ``vllm:kv_cache_usage_perc``) is back at its baseline
  within `chaos_stack.settle_bound_s` after the last request (no leaked or
  forever-quarantined blocks);
- no process died that was not killed on purpose, and every engine answers /health;
- the router's resident memory grew by less than `RSS_GROWTH_MB` over its longest life.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import subprocess
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import date
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

from kvferry.router.wire.headers import OPERATOR_TOKEN_ENV

from .chaos_faults import Injector, Plan, hook_events, schedule
from .chaos_stack import ChaosStack, settle_bound_s
from .chaos_traffic import Outcome, Workload, build, references, send
from .procs import stop_on_signals

RSS_GROWTH_MB = 100.0
CLEAR = ("ok", "error")  # always acceptable outcomes
ROUTER_DOWN = ("conn_error", "truncated")  # acceptable from a process being killed
BACKOFF_S = 1.0  # a client whose connection failed waits this long before its next request


@dataclass
class Books:
    """Everything a chaos run checks at its end: outcomes, leaks, crashes, RSS, violations."""

    outcomes: list[Outcome] = field(default_factory=list)
    leaked: dict[str, float] = field(default_factory=dict)  # engine -> blocks not freed
    crashes: list[str] = field(default_factory=list)
    unhealthy: list[str] = field(default_factory=list)
    rss: list[tuple[int, float]] = field(default_factory=list)  # (router incarnation, MB)
    violations: list[str] = field(default_factory=list)
    table: list[dict[str, Any]] = field(default_factory=list)
    faults: int = 0
    hook_hits: Counter = field(default_factory=Counter)
    # Block checksums (every READ checked): bytes the corrupt fault flipped, and READs
    # whose check failed; equal when every corruption was caught and no other was found.
    corruptions_injected: int = 0
    corruptions_caught: int = 0

    def count(self, kind: str) -> int:
        return sum(1 for o in self.outcomes if o.kind == kind)


def _down(stack: ChaosStack, inj: Injector) -> dict[str, list[tuple[float, float]]]:
    """URL -> when that process was down on purpose (killed until healthy again)."""
    urls = {p.name: p.url for p in stack.procs}
    out: dict[str, list[tuple[float, float]]] = {}
    for e in inj.events:
        if e.kind.startswith("kill_") and e.target in urls:
            out.setdefault(urls[e.target], []).append((e.t0, (e.t1 or time.time()) + 2.0))
    return out


def _acceptable(o: Outcome, down: dict[str, list[tuple[float, float]]], router: str) -> bool:
    """A clear end; or, talking to a process that was being killed, a refused or broken
    connection (the router answers for the engines behind it, so only its own death
    excuses a request sent to it)."""
    if o.item.expect == "error":
        return o.kind == "error" and 400 <= o.status < 500
    if o.kind in CLEAR:
        return True
    windows = down.get(o.item.target or router, [])
    return o.kind in ROUTER_DOWN and any(a <= o.t1 and o.t0 <= b for a, b in windows)


def _blocks(stack: ChaosStack, usage: float, url: str) -> float:
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return usage
    for ln in text.splitlines():
        if ln.startswith("vllm:cache_config_info") and 'num_gpu_blocks="' in ln:
            return round(usage * int(ln.split('num_gpu_blocks="')[1].split('"')[0]), 1)
    return usage


def settle(stack: ChaosStack, baseline: dict[str, float], bound_s: float) -> dict[str, float]:
    """Wait (at most ``bound_s``) for every engine's KV usage to return to its baseline;
    the engines still above it, in blocks."""
    deadline = time.monotonic() + bound_s
    left: dict[str, float] = {}
    while True:
        left = {}
        for e in stack.engines:
            u = stack.kv_usage(e)
            if u is None or u > baseline[e.name] + 1e-9:
                left[e.name] = float("nan") if u is None else _blocks(stack, u - baseline[e.name],
                                                                      e.url)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(2.0)


def books(stack: ChaosStack, inj: Injector, outcomes: list[Outcome], baseline: dict[str, float],
          rss: list[tuple[int, float]], events_dir: Path) -> Books:
    b = Books(outcomes=list(outcomes), rss=rss, faults=len(inj.events))
    down = _down(stack, inj)
    for o in b.outcomes:
        if not _acceptable(o, down, stack.router.url):
            b.violations.append(f"{o.kind} ({o.item.fault or 'traffic'}, {o.item.endpoint}, "
                                f"{o.item.mode}, stream={o.item.stream}): {o.detail}")
    b.leaked = settle(stack, baseline, settle_bound_s(stack.extra))
    b.violations += [f"{name}: {n} KV blocks not freed within {settle_bound_s(stack.extra):.0f}s"
                     for name, n in b.leaked.items()]
    b.crashes = [f"{p.name} {c}" for p in stack.procs for c in p.crashes]
    b.violations += [f"crash: {c}" for c in b.crashes]
    b.unhealthy = [p.name for p in stack.procs if not p.healthy()]
    b.violations += [f"unhealthy at the end: {n}" for n in b.unhealthy]
    last = max((i for i, _ in rss), default=0)
    mine = [mb for i, mb in rss if i == last]
    if len(mine) >= 2 and mine[-1] - min(mine) > RSS_GROWTH_MB:
        b.violations.append(f"router RSS grew {mine[-1] - min(mine):.0f} MB")
    for ev in hook_events(events_dir):
        b.hook_hits[f"{ev['point']}:{ev['action']}"] += 1
    counts = stack.checksum_counts()
    b.corruptions_injected = counts["corruptions_injected"]
    b.corruptions_caught = counts["checksum_mismatches"]
    if b.corruptions_caught != b.corruptions_injected:
        b.violations.append(f"checksums: {b.corruptions_injected} corruptions injected, "
                            f"{b.corruptions_caught} transfers failed their check")
    b.table = table(inj, b.outcomes)
    return b


def table(inj: Injector, outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """fault -> how often it was injected and how the requests it touched ended: those
    it sent itself, and the background requests in flight while it was on."""
    rows: dict[str, dict[str, Any]] = {}
    for ev in inj.events:
        row = rows.setdefault(ev.kind, {"fault": ev.kind, "count": 0, "outcomes": Counter()})
        row["count"] += 1
        t1 = ev.t1 or time.time()
        touched = ev.outcomes or [o for o in outcomes if not o.item.fault
                                  and o.t0 <= t1 and ev.t0 <= o.t1]
        row["outcomes"].update(o.kind for o in touched)
    quiet = [o for o in outcomes if not o.item.fault and not any(
        o.t0 <= (e.t1 or time.time()) and e.t0 <= o.t1 for e in inj.events)]
    rows["none"] = {"fault": "none", "count": 0, "outcomes": Counter(o.kind for o in quiet)}
    return [{**r, "outcomes": dict(r["outcomes"])} for r in rows.values()]


def print_books(b: Books, echo: Any = print) -> None:
    kinds = ("ok", "error", "wrong", "hang", "conn_error", "truncated", "unclear_error")
    echo(f"{'fault':24} {'count':>5} " + " ".join(f"{k:>13}" for k in kinds))
    for r in b.table:
        echo(f"{r['fault']:24} {r['count']:>5} "
             + " ".join(f"{r['outcomes'].get(k, 0):>13}" for k in kinds))
    echo(f"requests {len(b.outcomes)}, faults {b.faults}, hook hits {dict(b.hook_hits)}")
    echo(f"corruptions injected {b.corruptions_injected}, caught {b.corruptions_caught}")
    echo(f"leaked {b.leaked or 0}, crashes {b.crashes or 0}, router RSS MB "
         f"{[round(mb) for _, mb in b.rss[:1] + b.rss[-1:]]}")
    for v in b.violations:
        echo(f"VIOLATION {v}")


@dataclass
class Session:
    """A started chaos stack with its workload, references and KV baseline: one chaos run
    drives it once, a soak (soak.py) drives it segment after segment."""

    stack: ChaosStack
    plan: Plan
    work: Workload
    baseline: dict[str, float]
    seed: int
    startup_s: float
    t_boot: float
    client: httpx.Client


def start(seed: int, logs: Path, ucx_tls: str | None = None, startup_s: float = 900.0,
          echo: Any = print) -> Session:
    """Start the 2P2D stack, warm each engine, build the workload and its colocated
    references; stop it with `Session.stack.stop()` (also when this raises)."""
    from .modelgen import write_model

    logs.mkdir(parents=True, exist_ok=True)
    # The books record which pair served each request: only the router's operator sees it
    # (its process inherits the token; the clients send it: chaos_traffic.send).
    os.environ.setdefault(OPERATOR_TOKEN_ENV, secrets.token_hex(16))
    model = str(write_model(logs / "model", "tiny", weights=True))
    plan = Plan(logs / "faults-plan.json", seed, logs / "fault-events")
    stack = ChaosStack(model, logs, secrets.token_hex(16), plan.path, ucx_tls)
    t_boot = time.monotonic()
    try:
        stack.start(startup_s)
        echo(f"stack up in {time.monotonic() - t_boot:.0f}s: "
             + ", ".join(f"{p.name} {p.url}" for p in stack.procs))
        client = httpx.Client(trust_env=False)
        for e in stack.engines:  # an engine's first forward is slow; not what is measured
            client.post(e.url + "/v1/completions", json={"model": model, "prompt": [11] * 64,
                                                         "max_tokens": 2}, timeout=300)
        baseline = {e.name: stack.kv_usage(e) or 0.0 for e in stack.engines}
        work = build(model, seed)
        references([p.url for p in stack.prefills], work, model, client)
    except BaseException:
        stack.stop()
        raise
    echo(f"{len(work.singles)} single requests and {len(work.conversations)} "
         f"conversations with references; baseline KV {baseline}")
    return Session(stack, plan, work, baseline, seed, startup_s, t_boot, client)


def segment(s: Session, duration_s: float, workers: int, seed: int, fault_every_s: float = 10.0
            ) -> tuple[Books, Injector, list[tuple[float, str]]]:
    """Traffic from ``workers`` clients for ``duration_s`` under the faults of
    ``schedule(seed, duration_s, fault_every_s)``; then every conversation ends, the KV settles and the
    books are drawn for this segment's requests (leaks, crashes and checksum counts are
    the stack's, since it started)."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def record(o: Outcome) -> None:
        with lock:
            outcomes.append(o)

    inj = Injector(s.stack, s.work, s.plan, seed, record, s.startup_s)
    stop = threading.Event()
    rss: list[tuple[int, float]] = []
    t0 = time.monotonic()
    sched = schedule(seed, duration_s, fault_every_s)
    threads = [threading.Thread(target=inj.run, args=(t0, sched, stop), daemon=True),
               threading.Thread(target=_sample_rss, args=(s.stack, rss, stop), daemon=True)]
    for th in threads:
        th.start()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda w: _traffic(s.stack, s.work, seed, w, t0 + duration_s, record),
                      range(workers)))
    threads[0].join()  # faults end (and restarted engines are back) before the books
    stop.set()
    _end_conversations(s.stack, outcomes, s.client)
    return books(s.stack, inj, outcomes, s.baseline, rss, s.plan.events), inj, sched


def run(seed: int, duration_s: float, logs: Path, workers: int = 3, ucx_tls: str | None = None,
        startup_s: float = 900.0, echo: Any = print) -> tuple[Books, dict[str, Any]]:
    """One chaos run; (books, facts for the results line)."""
    with stop_on_signals():  # SIGTERM/SIGINT: `start` and the `finally` stop every engine
        return _run(seed, duration_s, logs, workers, ucx_tls, startup_s, echo)


def _run(seed: int, duration_s: float, logs: Path, workers: int, ucx_tls: str | None,
         startup_s: float, echo: Any) -> tuple[Books, dict[str, Any]]:
    s = start(seed, logs, ucx_tls, startup_s, echo)
    try:
        b, inj, sched = segment(s, duration_s, workers, seed)
        _dump(logs / "outcomes.jsonl", b.outcomes, s.stack.router.url)
        s.client.close()
        facts = {"duration_s": duration_s, "workers": workers, "ucx_tls": ucx_tls or "",
                 "checksums": s.stack.extra["kv_checksums"],
                 "wall_s": round(time.monotonic() - s.t_boot), "schedule": [k for _, k in sched],
                 "events": [{"fault": e.kind, "target": e.target, "detail": e.detail}
                            for e in inj.events]}
        return b, facts
    finally:
        s.stack.stop()


def _dump(path: Path, outcomes: list[Outcome], router: str) -> None:
    """Every request's end, for a post-mortem (the books only count them)."""
    with path.open("w") as f:
        for o in outcomes:
            f.write(json.dumps({
                "fault": o.item.fault, "endpoint": o.item.endpoint, "mode": o.item.mode,
                "stream": o.item.stream, "target": o.item.target or router, "cid": o.item.cid,
                "kind": o.kind, "status": o.status, "detail": o.detail, "t0": o.t0, "t1": o.t1,
                "reuse": o.headers.get("x-kvferry-reuse-reason", ""),
                "prefill": o.headers.get("x-kvferry-prefill", ""),
                "decode": o.headers.get("x-kvferry-decode", "")}) + "\n")


def _sample_rss(stack: ChaosStack, rss: list[tuple[int, float]], stop: threading.Event) -> None:
    while not stop.wait(5.0):
        mb = stack.router_rss_mb()
        if mb is not None:
            rss.append((stack.router.incarnation, mb))


def _traffic(stack: ChaosStack, work: Workload, seed: int, worker: int, deadline: float,
             record: Any) -> None:
    """One client: seeded picks of single requests and whole conversations until the end."""
    rng = random.Random(seed * 1000 + worker)
    n = 0
    with httpx.Client(trust_env=False) as client:
        while time.monotonic() < deadline:
            n += 1
            if rng.random() < 0.35:
                conv = rng.choice(work.conversations)
                cid = f"chaos-{seed}-{worker}-{n}"
                for item in conv.turns:
                    out = send(stack.router.url, _with(item, cid), client)
                    record(out)
                    if out.kind != "ok" or time.monotonic() > deadline:
                        break  # the client gives up this conversation
            else:
                out = send(stack.router.url, rng.choice(work.singles), client)
                record(out)
            if out.kind == "conn_error":
                time.sleep(BACKOFF_S)


def _with(item: Any, cid: str) -> Any:
    return replace(item, cid=cid)


def _end_conversations(stack: ChaosStack, outcomes: list[Outcome], client: httpx.Client) -> None:
    """End every conversation the clients started (a router that was killed has forgotten
    some: their leases end by TTL, which the settle bound covers)."""
    for cid in sorted({o.item.cid for o in outcomes if o.item.cid}):
        with contextlib.suppress(httpx.HTTPError):
            client.delete(f"{stack.router.url}/v1/kvferry/conversations/{cid}", timeout=30)


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def result_lines(b: Books, facts: dict[str, Any], seed: int, command: str) -> list[dict]:
    """One line for the run and one per fault (benchmarks/results schema)."""
    head = {"experiment": "chaos", "impl": "kvferry", "hardware": "cpu", "model": "tiny",
            "mode": "mixed", "seed": seed, "requests": len(b.outcomes), "faults_injected": b.faults,
            "wrong_outputs": b.count("wrong"), "hangs": b.count("hang"),
            "leaked_blocks": sum(v for v in b.leaked.values() if v == v) if b.leaked else 0,
            "crashes": len(b.crashes), "violations": b.violations,
            "outcomes": dict(Counter(o.kind for o in b.outcomes)),
            "hook_hits": dict(b.hook_hits),
            "corruptions_injected": b.corruptions_injected,
            "corruptions_caught": b.corruptions_caught,
            "router_rss_mb": [round(mb, 1) for _, mb in b.rss[:1] + b.rss[-1:]],
            "command": command, "commit": commit(), "date": date.today().isoformat(), **facts}
    return [head] + [{"experiment": "chaos", "seed": seed, "commit": head["commit"], **r}
                     for r in b.table]


def chaos(
    seed: Annotated[int, typer.Option(help="Seeds the traffic, the schedule and the hooks.")] = 1,
    duration: Annotated[float, typer.Option(help="Seconds of traffic under faults.")] = 600.0,
    workers: Annotated[int, typer.Option(help="Concurrent clients.")] = 3,
    logs: Annotated[Path, typer.Option(help="Engine/router logs and the fault plan.")] = Path(
        ".kvferry/chaos"),
    results: Annotated[Path | None, typer.Option(
        help="Directory for the JSON-lines results (chaos-cpu-<date>.jsonl).")] = Path(
        "benchmarks/results"),
    ucx_tls: Annotated[str | None, typer.Option(
        help="UCX_TLS for the engines (e.g. ^cma: no cross-memory attach, as in many "
             "containers).")] = None,
) -> None:
    """Real 2P2D engines + router under seeded faults; prints fault x count x outcome and
    exits 1 on any violated invariant."""
    import sys

    command = " ".join(["kvferry", *sys.argv[1:]])
    b, facts = run(seed, duration, logs, workers, ucx_tls, echo=typer.echo)
    print_books(b, typer.echo)
    if results is not None:
        results.mkdir(parents=True, exist_ok=True)
        path = results / f"chaos-cpu-{date.today().strftime('%Y%m%d')}.jsonl"
        n = 0
        while path.exists():
            n += 1
            path = results / f"chaos-cpu-{date.today().strftime('%Y%m%d')}-{n}.jsonl"
        with path.open("w") as f:
            for line in result_lines(b, facts, seed, command):
                f.write(json.dumps(line) + "\n")
        typer.echo(f"results: {path}")
    raise typer.Exit(1 if b.violations else 0)
