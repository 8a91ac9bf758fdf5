"""`kvferry plan`: the planner's model (capacity.py) calibrated from kvferry's benchmark
results, checked against a discrete-event simulation of the fleet; a load that shifts from
long prompts to long answers moves its P:D ratio the right way and holds the SLO in the
simulation where a fixed half/half split misses it; loads read from Prometheus scrapes
and recorded runs; the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from typer.testing import CliRunner

from kvferry.router.metrics import RouterMetrics
from kvferry.scripts.capacity import Calibration, Load, Slo, estimate, max_streams, recommend
from kvferry.scripts.capacity_calibrate import calibrate, loads_from_bench
from kvferry.scripts.capacity_cli import read_rows, result_files
from kvferry.scripts.capacity_metrics import MetricsError, load_from_scrapes
from kvferry.scripts.capacity_shift import SLO, shift_rows
from kvferry.scripts.capacity_sim import simulate
from kvferry.scripts.cli import app

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


@pytest.fixture(scope="module")
def cal() -> Calibration:
    return calibrate(read_rows(result_files(RESULTS)), "qwen3-8b", "h200")


def test_calibration_recovers_known_speeds() -> None:
    """Rows made from known speeds give those speeds back: prefill 20k tok/s + 30 ms a
    prompt (lightest load per length only), a step of 6 + 0.25 ms per stream, handoff
    2 us a token; one-accelerator (x1) P/D rows and other models are left out."""
    rows = []
    for n in (2048, 8192, 16384):
        for qps, extra in ((1.0, 0.0), (4.0, 500.0)):  # the loaded row's queueing is ignored
            rows.append({"experiment": "push_vs_pull", "impl": "kvferry", "mode": "push",
                         "model": "m", "hardware": "h200x2", "input_len": n, "qps": qps,
                         "prefill_ms_p50": 30 + n / 20 + extra, "handoff_ms_p50": n * 0.002})
    for b in (1, 8, 32):
        tpot = 6 + 0.25 * b
        rows.append({"experiment": "push_vs_pull", "impl": "kvferry", "mode": "pull",
                     "model": "m", "hardware": "h200x4", "input_len": 1000, "qps": 9.0,
                     "achieved_qps": b / (64 * tpot / 1000), "output_len": 64, "tpot_ms_p50": tpot})
    rows.append({"experiment": "push_vs_pull", "impl": "kvferry", "mode": "push", "model": "m",
                 "hardware": "h200x1", "input_len": 2048, "qps": 0.5, "prefill_ms_p50": 9999})
    rows.append({"experiment": "push_vs_pull", "impl": "kvferry", "mode": "push", "model": "other",
                 "hardware": "h200x2", "input_len": 2048, "qps": 0.5, "prefill_ms_p50": 1})
    c = calibrate(rows, "m", "h200")
    assert c.prefill_tok_s == pytest.approx(20000)
    assert c.prefill_fixed_ms == pytest.approx(30)
    assert (c.step_ms, c.step_ms_per_seq) == (pytest.approx(6), pytest.approx(0.25))
    assert c.transfer_ms_per_token == pytest.approx(0.002)


def test_calibration_from_kvferrys_results(cal: Calibration) -> None:
    """qwen3-8b on H200 (P and D on GPUs of their own): ~16k prompt tok/s per engine from
    the ~1 s prefill of a 16k prompt, a ~5 ms step growing with the batch (16 streams:
    ~9.5 ms), a ~2 us/token handoff."""
    assert 14_000 < cal.prefill_tok_s < 18_000
    assert 4.5 < cal.step_ms < 6 and 0.1 < cal.step_ms_per_seq < 0.5
    assert 8.5 < cal.step_ms + 16 * cal.step_ms_per_seq < 10.5
    assert 0 < cal.transfer_ms_per_token < 0.01
    assert "4 prefill" in cal.source  # the h200x2 rows, not the shared-GPU h200x1 ones


def test_model_agrees_with_the_simulation(cal: Calibration) -> None:
    for load, p, d in ((Load(7.5, 8000, 150, prompt_tokens_p90=11200), 6, 2),
                       (Load(8.0, 500, 1500, prompt_tokens_p90=700), 1, 7),
                       (Load(8.0, 500, 1500, prompt_tokens_p90=700), 4, 4)):
        model = estimate(cal, load, p, d)
        sim = simulate(cal, load, p, d, 150, seed=3)
        assert sim.requests > 500
        assert model.itl_p90_s == pytest.approx(sim.itl_p90_s, rel=0.15)
        assert model.ttft_p90_s == pytest.approx(sim.ttft_p90_s, rel=0.25)
        assert model.decode_batch == pytest.approx(sim.mean_batch, rel=0.25)


def test_the_decode_batch_target_for_the_autoscaler(cal: Calibration) -> None:
    """The streams per D the planner names for --scale-decode-running keep ITL p90 in the
    SLO, and one more does not."""
    slo = Slo(1.5, 0.015)
    rec = recommend(cal, Load(8.0, 500, 1500), slo)
    b = max_streams(cal, slo)
    assert any(f"--scale-decode-running {b}" in r for r in rec.reasons)
    p90 = lambda n: cal.step_s(n + 1.2816 * math.sqrt(n))  # noqa: E731
    assert p90(b) <= slo.itl_s < p90(b + 1)


def test_overload_is_unbounded_not_a_number(cal: Calibration) -> None:
    e = estimate(cal, Load(10.0, 16384, 64), 1, 1)  # 164k prompt tok/s on one ~16k P
    assert e.ttft_p90_s == math.inf and not e.holds(Slo(10, 1))
    rec = recommend(cal, Load(10.0, 16384, 64), Slo(2.0, 0.015), budget=4)
    assert not rec.fits and rec.estimate.prefill + rec.estimate.decode == 4
    assert any("needs" in r for r in rec.reasons)


def test_shifting_load_moves_the_ratio_and_holds_the_slo(cal: Calibration) -> None:
    rows = shift_rows(cal, seconds=120, seed=0)
    ratios = [r["plan_prefill"] / r["plan_decode"] for r in rows]
    assert ratios == sorted(ratios, reverse=True) and ratios[0] > 1 > ratios[-1]
    for r in rows:
        assert r["plan_fits"] and r["plan_prefill"] + r["plan_decode"] == r["engines"]
        assert r["sim_holds"], r  # the planner's split holds TTFT and ITL p90 in simulation
        assert r["sim_ttft_ms_p90"] <= SLO.ttft_s * 1000 and r["sim_itl_ms_p90"] <= SLO.itl_s * 1000
    first, last = rows[0], rows[-1]
    assert not first["fixed_holds"] and first["fixed_ttft_ms_p90"] > SLO.ttft_s * 1000
    assert not last["fixed_holds"] and last["fixed_itl_ms_p90"] > SLO.itl_s * 1000


def _vllm_text(prompts: list[int], answers: list[int]) -> str:
    """An engine's /metrics with vLLM's metric names (prometheus_client, as vLLM uses)."""
    reg = CollectorRegistry()
    ok = Counter("vllm:request_success", "", ["finished_reason"], registry=reg)
    pt = Histogram("vllm:request_prompt_tokens", "", buckets=(256, 1024, 4096, 16384), registry=reg)
    gt = Histogram("vllm:request_generation_tokens", "", buckets=(16, 128, 1024), registry=reg)
    for n in prompts:
        pt.observe(n)
        ok.labels("length").inc()
    for n in answers:
        gt.observe(n)
    return generate_latest(reg).decode()


def test_load_from_two_scrapes() -> None:
    router = RouterMetrics()
    before = {"router": [router.render().decode()],
              "prefill": [_vllm_text([100] * 5, [1] * 5), _vllm_text([], [])],
              "decode": [_vllm_text([100] * 5, [50] * 5)]}
    router.requests.labels("chat", "push").inc(30)
    router.requests.labels("completions", "pull").inc(30)
    after = {"router": [router.render().decode()],
             "prefill": [_vllm_text([100] * 5 + [3000] * 20, [1] * 25),
                         _vllm_text([3000] * 9 + [200] * 1, [1] * 10)],
             "decode": [_vllm_text([100] * 5 + [3000] * 30, [50] * 5 + [400] * 30)]}
    load = load_from_scrapes(before, after, 30.0)
    assert load.qps == pytest.approx(2.0)  # 60 requests the routers saw in 30 s
    assert load.prompt_tokens == pytest.approx((29 * 3000 + 200) / 30)
    assert load.prompt_tokens_p90 == 4096  # the bucket holding the 90th percentile
    assert load.answer_tokens == pytest.approx(400)
    with pytest.raises(MetricsError, match="went down"):
        load_from_scrapes(after, before, 30.0)
    with pytest.raises(MetricsError, match="answer tokens"):
        load_from_scrapes(before, {**after, "decode": before["decode"]}, 30.0)
    no_router = {k: v for k, v in after.items() if k != "router"}
    assert load_from_scrapes(before, no_router, 30.0).qps == pytest.approx(30 / 30)


def test_plan_cli_on_a_recorded_run_and_on_scrapes(tmp_path: Path) -> None:
    run = RESULTS / "push_vs_pull-h200x2-20261201b.jsonl"
    r = CliRunner().invoke(app, ["plan", "--bench", str(run), "--json", "--engines", "6",
                                 "--ttft-ms", "1500", "--itl-ms", "15"])
    assert r.exit_code == 0, r.output
    plans = [json.loads(ln) for ln in r.output.splitlines() if ln.startswith("{")]
    assert len(plans) == len(loads_from_bench(read_rows([run])))
    eight_b = [p for p in plans if p["calibration"].startswith("qwen3-8b")]
    assert eight_b and all(p["prefill"] + p["decode"] == 6 for p in plans)
    # 16k prompts and 64-token answers: prefill-bound, more P than D
    assert all(p["prefill"] > p["decode"] and p["holds"] for p in eight_b)
    assert all(any("this run (1P+1D) measured" in x for x in p["reasons"]) for p in plans)

    before, after = tmp_path / "p0.txt", tmp_path / "p1.txt"
    before.write_text(_vllm_text([], []))
    after.write_text(_vllm_text([12000] * 60, [1] * 60))
    d0, d1 = tmp_path / "d0.txt", tmp_path / "d1.txt"
    d0.write_text(_vllm_text([], []))
    d1.write_text(_vllm_text([12000] * 60, [100] * 60))
    args = ["plan", "--metrics", f"prefill={before}", "--metrics", f"decode={d0}",
            "--metrics-after", f"prefill={after}", "--metrics-after", f"decode={d1}",
            "--window", "10", "--simulate", "--sim-seconds", "60"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "observed over 10 s" in r.output and "6 req/s" in r.output
    assert "simulated (60 s" in r.output and "holds the SLO" in r.output
    r = CliRunner().invoke(app, ["plan", "--metrics", f"prefill={before}"])
    assert r.exit_code == 2 and "--metrics-after" in r.output
    r = CliRunner().invoke(app, ["plan"])
    assert r.exit_code == 2
    r = CliRunner().invoke(app, ["plan", "--qps", "1", "--model", "no-such-model"])
    assert r.exit_code == 2 and "no kvferry P/D rows" in r.output


def test_plan_cli_records_the_shift_simulation(tmp_path: Path) -> None:
    out = tmp_path / "plan-sim.jsonl"
    r = CliRunner().invoke(app, ["plan", "--simulate-shift", str(out), "--sim-seconds", "60"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r["load"] for r in rows] == ["long prompts", "halfway", "long answers"]
    for row in rows:
        assert row["experiment"] == "plan" and row["date"] and "command" in row
        assert "commit" in row and row["model"] == "qwen3-8b"
    assert rows[0]["plan_prefill"] > rows[0]["plan_decode"]
    assert rows[-1]["plan_prefill"] < rows[-1]["plan_decode"]
