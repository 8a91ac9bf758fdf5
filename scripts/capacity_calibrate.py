"""The planner's engine speeds from kvferry's own benchmark rows (benchmarks/results/*.jsonl,
the bench schema), and a load from a recorded run: pure functions over parsed rows.

- prefill tok/s and fixed cost: a robust (Theil-Sen) line through (prompt tokens,
  ``prefill_ms_p50``) of the kvferry P/D rows at their lightest load (the prefill leg
  alone, as the router timed it), on P and D of their own (not the x1 rows, where both
  shared one accelerator);
- decode step: a line through (streams per D, TPOT): a P/D row's streams per D are
  ``achieved_qps / D engines * output_len * TPOT`` (Little), a ``bidirectional_load``
  row's are its ``background_streams``;
- handoff: the median of ``handoff_ms_p50 / input_len`` over push rows.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable
from typing import Any

from .capacity import Calibration, Load

PD_MODES = ("push", "pull")


class CalibrationError(ValueError):
    """The results hold no usable rows of this model and accelerator to calibrate from."""


def _family(hardware: str) -> str:
    """h200x4 -> h200: the rows of one accelerator, whatever the engine count."""
    return re.sub(r"x\d+$", "", hardware)


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the Theil-Sen line (median of pairwise slopes): runs that went
    wrong for reasons of their own do not drag it; slope 0 when the x values do not spread."""
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points)
              for x2, y2 in points[i + 1:] if x2 != x1]
    slope = statistics.median(slopes) if slopes else 0.0
    return statistics.median(y - slope * x for x, y in points), slope


def _decode_engines(row: dict[str, Any]) -> int:
    return 2 if row.get("experiment") == "2p2d" else 1


def calibrate(rows: Iterable[dict[str, Any]], model: str, hardware: str) -> Calibration:
    """Speeds of ``model`` on ``hardware`` (h200 matches h200x1, h200x2 ...)."""
    fam = _family(hardware)
    mine = [r for r in rows if r.get("model") == model and _family(r.get("hardware", "")) == fam
            and r.get("impl", "kvferry") == "kvferry"]
    # P/D rows of one accelerator (x1) had both roles share it: not one engine's speed
    pd = [r for r in mine if r.get("mode") in PD_MODES and r.get("input_len")
          and not r.get("hardware", "").endswith("x1")]
    lightest: dict[int, float] = {}
    for r in pd:
        if r.get("prefill_ms_p50") is not None:
            q = r.get("qps") or 0
            lightest[r["input_len"]] = min(lightest.get(r["input_len"], q), q)
    pre = [(r["input_len"], r["prefill_ms_p50"]) for r in pd if r.get("prefill_ms_p50")
           and (r.get("qps") or 0) == lightest[r["input_len"]]]
    if not pre:
        raise CalibrationError(f"no kvferry P/D rows with prefill_ms_p50 for {model} on {fam}")
    fixed_ms, ms_per_token = _line(pre)
    if ms_per_token <= 0:  # one prompt length: all of it is per-token work
        fixed_ms, ms_per_token = 0.0, statistics.fmean(ms / n for n, ms in pre)
    steps = [(r["achieved_qps"] / _decode_engines(r) * r["output_len"] * r["tpot_ms_p50"] / 1000,
              r["tpot_ms_p50"]) for r in pd if r.get("tpot_ms_p50") and r.get("achieved_qps")
             and r.get("sustainable", True)]
    steps += [(r["background_streams"], r["background_tpot_ms_p50"]) for r in mine
              if r.get("experiment") == "bidirectional_load" and r.get("mode") == "no_turns"
              and r.get("background_tpot_ms_p50")]
    if not steps:
        raise CalibrationError(f"no rows with a decode TPOT for {model} on {fam}")
    step_ms, per_seq = _line(steps)
    handoff = [r["handoff_ms_p50"] / r["input_len"] for r in pd
               if r.get("mode") == "push" and r.get("handoff_ms_p50")]
    return Calibration(
        prefill_tok_s=1000 / ms_per_token, prefill_fixed_ms=max(0.0, fixed_ms),
        step_ms=max(step_ms, 0.1), step_ms_per_seq=max(per_seq, 0.0),
        transfer_ms_per_token=statistics.median(handoff) if handoff else 0.0,
        source=f"{model} on {fam}: {len(pre)} prefill, {len(steps)} decode, {len(handoff)} "
               "handoff rows")


def loads_from_bench(rows: Iterable[dict[str, Any]]) -> list[tuple[Load, dict[str, Any]]]:
    """Each kvferry P/D point of a recorded run as a load (offered rate, lengths), with
    its row (what was measured there)."""
    out = []
    for r in rows:
        if r.get("impl", "kvferry") == "kvferry" and r.get("mode") in PD_MODES \
                and r.get("input_len") and r.get("qps"):
            qps = r.get("offered_qps_actual") or r["qps"]
            out.append((Load(qps, r["input_len"], r.get("output_tokens_mean") or r["output_len"],
                             f"{r.get('target', r['mode'])} @ {r['qps']:g} qps"), r))
    return out
