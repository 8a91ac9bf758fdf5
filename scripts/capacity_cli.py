"""`kvferry plan`: how many prefill and decode engines hold a TTFT and an inter-token SLO
for the load a fleet sees (its Prometheus metrics), a recorded benchmark run, or a load
given by hand; engine speeds calibrated from kvferry's own benchmark results. The model
is capacity.py; this module only reads files and URLs and prints."""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

from .bench import git_commit
from .capacity import Calibration, Load, Recommendation, Slo, estimate, recommend
from .capacity_calibrate import CalibrationError, calibrate, loads_from_bench
from .capacity_metrics import ROLES, MetricsError, load_from_scrapes
from .capacity_shift import shift_rows
from .capacity_sim import simulate

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def read_rows(paths: list[Path]) -> list[dict[str, Any]]:
    rows = []
    for p in paths:
        rows += [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()]
    return rows


def result_files(results: Path) -> list[Path]:
    """Summary rows only (not the per-request or timeline files beside them)."""
    return sorted(p for p in results.glob("*.jsonl")
                  if not p.name.endswith((".requests.jsonl", ".timeline.jsonl")))


def _read_source(src: str) -> str:
    if src.startswith(("http://", "https://")):
        r = httpx.get(src, timeout=10)
        r.raise_for_status()
        return r.text
    return Path(src).read_text()


def _by_role(specs: list[str]) -> dict[str, list[str]]:
    """ROLE=SOURCE, ... -> role -> sources."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        role, sep, src = spec.partition("=")
        if not sep or role not in ROLES:
            raise typer.BadParameter(f"{spec!r}: expected ROLE=URL_OR_FILE, ROLE one of {ROLES}")
        out.setdefault(role, []).append(src)
    return out


def observed_load(metrics: list[str], metrics_after: list[str], window: float) -> Load:
    before_src = _by_role(metrics)
    after_src = _by_role(metrics_after)
    before = {r: [_read_source(s) for s in ss] for r, ss in before_src.items()}
    if not after_src:
        if any(not s.startswith("http") for ss in before_src.values() for s in ss):
            raise typer.BadParameter("files are one scrape each: give the later one with "
                                     "--metrics-after (and --window, the seconds between)")
        time.sleep(window)
        after_src = before_src
    after = {r: [_read_source(s) for s in ss] for r, ss in after_src.items()}
    return load_from_scrapes(before, after, window)


def measured(cal: Calibration, load: Load, run: dict[str, Any]) -> str:
    """What the recorded run measured beside what the model says of its own fleet."""
    p = d = 2 if run.get("experiment") == "2p2d" else 1
    e = estimate(cal, load, p, d)
    return (f"this run ({p}P+{d}D) measured TTFT p90 {run.get('ttft_ms_p90')} ms, TPOT p50 "
            f"{run.get('tpot_ms_p50')} ms; the model of that fleet says TTFT p90 "
            f"{_ms(e.ttft_p90_s)}, ITL p90 {_ms(e.itl_p90_s, 1)}")


def _ms(seconds: float, digits: int = 0) -> str:
    return f"{seconds * 1000:.{digits}f} ms" if seconds != float("inf") else "unbounded (queue grows)"


def _row(rec: Recommendation, load: Load, slo: Slo) -> dict[str, Any]:
    e = rec.estimate
    return {"load": load.label, "qps": load.qps, "prompt_tokens": load.prompt_tokens,
            "answer_tokens": load.answer_tokens, "prefill": e.prefill, "decode": e.decode,
            "fits": rec.fits, "holds": e.holds(slo), "ttft_ms_p90": round(e.ttft_p90_s * 1000, 1),
            "itl_ms_p90": round(e.itl_p90_s * 1000, 2), "reasons": rec.reasons}


# typer options are declared per command (typer reads them from the signature), so this
# one's `Annotated[..., typer.Option(help=...)]` lines share a shape with `bench`'s.
def plan_command(
    metrics: Annotated[list[str] | None, typer.Option(
        help="ROLE=URL_OR_FILE of a router's or engine's /metrics (ROLE: router, prefill, "
        "decode; repeat for each). URLs are scraped twice, --window apart.")] = None,
    metrics_after: Annotated[list[str] | None, typer.Option(
        help="ROLE=FILE: the later scrape of each file given with --metrics")] = None,
    window: Annotated[float, typer.Option(help="seconds between the two scrapes")] = 60.0,
    bench: Annotated[Path | None, typer.Option(
        help="a recorded run (benchmarks/results/*.jsonl): a plan for each P/D point")] = None,
    qps: Annotated[float | None, typer.Option(help="or a load by hand: requests/s")] = None,
    prompt_tokens: Annotated[float, typer.Option(help="with --qps: mean prompt tokens")] = 1000,
    answer_tokens: Annotated[float, typer.Option(help="with --qps: mean answer tokens")] = 200,
    ttft_ms: Annotated[float, typer.Option(help="SLO: TTFT p90, ms")] = 1500,
    itl_ms: Annotated[float, typer.Option(help="SLO: inter-token time p90, ms")] = 15,
    engines: Annotated[int | None, typer.Option(
        help="engines to split between P and D (default: as many as needed)")] = None,
    model: Annotated[str | None, typer.Option(
        help="calibrate from this model's rows (default: the bench file's, else qwen3-8b)")] = None,
    hardware: Annotated[str, typer.Option(help="... on this accelerator (h200x2 = h200)")] = "h200",
    results: Annotated[Path, typer.Option(help="benchmark results to calibrate from")] = RESULTS,
    simulate_shift: Annotated[Path | None, typer.Option(
        help="instead: run the shifting-load simulation (capacity_shift.py) and write its "
        "rows to this .jsonl")] = None,
    sim_seconds: Annotated[float, typer.Option(help="simulated seconds per run")] = 300,
    check: Annotated[bool, typer.Option(
        "--simulate", help="also run each plan through the simulation")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per plan")] = False,
) -> None:
    """How many prefill and decode engines hold the SLO for a load, and why."""
    bench_rows = read_rows([bench]) if bench else []
    calibration_rows = read_rows(result_files(results))
    calibrations: dict[str, Calibration] = {}

    def calibrated(name: str) -> Calibration:
        if name not in calibrations:
            try:
                calibrations[name] = calibrate(calibration_rows, name, hardware)
            except CalibrationError as e:
                typer.echo(f"error: {e} (in {results})", err=True)
                raise typer.Exit(2) from None
        return calibrations[name]

    cal = calibrated(model or "qwen3-8b")
    if simulate_shift:
        commit, dirty = git_commit()
        now = dt.datetime.now(dt.UTC)
        meta = {"experiment": "plan", "impl": "kvferry", "hardware": hardware,
                "model": model or "qwen3-8b",
                "command": " ".join(["kvferry", "plan", *sys.argv[2:]]), "commit": commit,
                "commit_dirty": dirty, "date": now.date().isoformat(),
                "time": now.isoformat(timespec="seconds")}
        rows = [{**meta, **r} for r in shift_rows(cal, sim_seconds)]
        simulate_shift.parent.mkdir(parents=True, exist_ok=True)
        simulate_shift.write_text("".join(json.dumps(r) + "\n" for r in rows))
        for r in rows:
            typer.echo(f"{r['load']:>13}: plan {r['plan_prefill']}P:{r['plan_decode']}D -> "
                       f"TTFT p90 {r['sim_ttft_ms_p90']} ms, ITL p90 {r['sim_itl_ms_p90']} ms "
                       f"({'holds' if r['sim_holds'] else 'MISSES'}); fixed "
                       f"{r['fixed_prefill']}P:{r['fixed_decode']}D -> {r['fixed_ttft_ms_p90']} / "
                       f"{r['fixed_itl_ms_p90']} ms ({'holds' if r['fixed_holds'] else 'misses'})")
        typer.echo(f"wrote {simulate_shift}")
        return
    try:
        loads: list[tuple[Load, dict[str, Any] | None]]
        if metrics:
            loads = [(observed_load(metrics, metrics_after or [], window), None)]
        elif bench_rows:
            loads = loads_from_bench(bench_rows)
        elif qps:
            loads = [(Load(qps, prompt_tokens, answer_tokens, "given"), None)]
        else:
            raise typer.BadParameter("give --metrics, --bench or --qps")
    except (MetricsError, httpx.HTTPError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if not loads:
        typer.echo(f"error: no kvferry P/D points in {bench}", err=True)
        raise typer.Exit(2)
    slo = Slo(ttft_ms / 1000, itl_ms / 1000)
    for load, run in loads:
        cal = calibrated(model or (run or {}).get("model") or "qwen3-8b")
        rec = recommend(cal, load, slo, budget=engines)
        if run:
            rec.reasons.append(measured(cal, load, run))
        if check:
            # lengths as spread as the load says (a p90 of 1.4x the mean: +-50 %)
            spread = min(1.0, max(0.0, (load.long_prompt / load.prompt_tokens - 1) / 0.8))
            sim = simulate(cal, load, rec.estimate.prefill, rec.estimate.decode, sim_seconds,
                           spread=spread)
            rec.reasons.append(f"simulated ({sim_seconds:g} s, {sim.requests} requests): TTFT p90 "
                               f"{sim.ttft_p90_s * 1000:.0f} ms, ITL p90 {sim.itl_p90_s * 1000:.1f} ms")
        if as_json:
            typer.echo(json.dumps({**_row(rec, load, slo), "calibration": cal.source}))
            continue
        typer.echo(f"# calibration: {cal.source}")
        e = rec.estimate
        verdict = "holds" if e.holds(slo) else "MISSES"
        typer.echo(f"{load.label or 'load'}: {e.prefill} prefill + {e.decode} decode "
                   f"(P:D {rec.ratio:.2f}) -> TTFT p90 ~{e.ttft_p90_s * 1000:.0f} ms, ITL p90 "
                   f"~{e.itl_p90_s * 1000:.1f} ms: {verdict} the SLO "
                   f"({ttft_ms:g} / {itl_ms:g} ms)")
        for reason in rec.reasons:
            typer.echo(f"  - {reason}")
