"""The shifting-load check of `kvferry plan` (pure): a fleet of a fixed number of engines
whose traffic moves from long prompts to long answers. At each step the planner's split
and a fixed half/half split are both run through the simulation (capacity_sim.py); the
planner's must hold the SLO where the fixed one misses it.

Lengths are drawn uniformly within +-50 % of the means (the simulation's default), so a
p90 prompt is 1.4 times the mean; the planner is told so, as a prompt-length histogram
would tell it.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from .capacity import Calibration, Load, Slo, recommend
from .capacity_sim import simulate

SPREAD = 0.5
SLO = Slo(ttft_s=1.5, itl_s=0.015)
BUDGET = 8  # engines, P and D together


def _load(qps: float, prompt: float, answer: float, label: str) -> Load:
    return Load(qps, prompt, answer, label, prompt_tokens_p90=prompt * (1 + 0.8 * SPREAD))


SHIFT = (
    _load(7.5, 8000, 150, "long prompts"),
    _load(7.5, 4250, 825, "halfway"),
    _load(8.0, 500, 1500, "long answers"),
)


def shift_rows(cal: Calibration, seconds: float = 300, seed: int = 0,
               steps: tuple[Load, ...] = SHIFT) -> list[dict[str, Any]]:
    """One row per step: the load, the planner's split and the simulated p90s of it and of
    the fixed half/half split."""
    rows = []
    half = BUDGET // 2
    for load in steps:
        rec = recommend(cal, load, SLO, budget=BUDGET)
        p, d = rec.estimate.prefill, rec.estimate.decode
        planned = simulate(cal, load, p, d, seconds, seed=seed, spread=SPREAD)
        fixed = simulate(cal, load, half, BUDGET - half, seconds, seed=seed, spread=SPREAD)
        rows.append({
            "load": load.label, "qps": load.qps, "prompt_tokens": load.prompt_tokens,
            "answer_tokens": load.answer_tokens, "engines": BUDGET,
            "slo_ttft_ms_p90": SLO.ttft_s * 1000, "slo_itl_ms_p90": SLO.itl_s * 1000,
            "plan_prefill": p, "plan_decode": d, "plan_fits": rec.fits,
            "model_ttft_ms_p90": round(rec.estimate.ttft_p90_s * 1000, 1),
            "model_itl_ms_p90": round(rec.estimate.itl_p90_s * 1000, 2),
            "sim_requests": planned.requests,
            "sim_ttft_ms_p90": round(planned.ttft_p90_s * 1000, 1),
            "sim_itl_ms_p90": round(planned.itl_p90_s * 1000, 2),
            "sim_holds": planned.ttft_p90_s <= SLO.ttft_s and planned.itl_p90_s <= SLO.itl_s,
            "fixed_prefill": half, "fixed_decode": BUDGET - half,
            "fixed_ttft_ms_p90": round(fixed.ttft_p90_s * 1000, 1),
            "fixed_itl_ms_p90": round(fixed.itl_p90_s * 1000, 2),
            "fixed_holds": fixed.ttft_p90_s <= SLO.ttft_s and fixed.itl_p90_s <= SLO.itl_s,
            "sim_seconds": seconds, "seed": seed, "spread": SPREAD,
            "calibration": {k: (round(v, 6) if isinstance(v, float) else v)
                            for k, v in asdict(cal).items()},
            "reasons": rec.reasons,
        })
    return rows
