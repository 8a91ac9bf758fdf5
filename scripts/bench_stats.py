"""Statistics of `kvferry bench` results: latency percentiles per point and whether the
stack kept up with the offered open-loop rate (the schema's fields)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from .bench_core import Result

SUSTAIN_MIN_RATIO = 0.8
"""Completion rate / offered rate below this: the stack falls behind (unsustainable)."""
SUSTAIN_MAX_ERROR_FRACTION = 0.1
"""More failed (non-timeout) requests than this fraction: unsustainable."""


def percentile(values: Sequence[float], p: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def latency_fields(results: Sequence[Result]) -> dict[str, Any]:
    """Schema latency fields over the successful requests (absent ones are omitted)."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    tpot = [r.tpot_ms for r in ok if r.tpot_ms is not None]
    t2 = [r.t2_ms for r in ok if r.t2_ms is not None]
    tpot_dec = [r.tpot_decode_ms for r in ok if r.tpot_decode_ms is not None]
    hand = [r.handoff_ms for r in ok if r.handoff_ms is not None]
    pre = [r.prefill_ms for r in ok if r.prefill_ms is not None]
    e2e = [r.e2e_ms for r in ok if r.e2e_ms is not None]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    reused = [r.reused_tokens for r in ok if r.reused_tokens is not None]
    reasons = Counter(r.reuse_reason or "unknown" for r in ok if r.reused_tokens is not None)
    out: dict[str, Any] = {
        "n": len(ok),
        "errors": len(results) - len(ok),
        "timeouts": sum(r.timed_out for r in results),
        "ttft_ms_p50": _r(percentile(ttft, 50)), "ttft_ms_p90": _r(percentile(ttft, 90)),
        "ttft_ms_p99": _r(percentile(ttft, 99)),
        "ttft_ms_mean": _r(sum(ttft) / len(ttft)) if ttft else None,
        "tpot_ms_p50": _r(percentile(tpot, 50)), "tpot_ms_p90": _r(percentile(tpot, 90)),
        # beside the schema: the second token's time, and TPOT from it on (Result.t2_ms)
        "t2_ms_p50": _r(percentile(t2, 50)), "t2_ms_p90": _r(percentile(t2, 90)),
        "tpot_decode_ms_p50": _r(percentile(tpot_dec, 50)),
        "tpot_decode_ms_p90": _r(percentile(tpot_dec, 90)),
        "e2e_ms_p50": _r(percentile(e2e, 50)),
        "handoff_ms_p50": _r(percentile(hand, 50)), "handoff_ms_p90": _r(percentile(hand, 90)),
        "prefill_ms_p50": _r(percentile(pre, 50)),
        "output_tokens_mean": _r(sum(r.n_tokens for r in ok) / len(ok), 2) if ok else None,
        "cached_tokens_mean": _r(sum(cached) / len(cached), 1) if cached else None,
        # Conversation turns after the first: history P read from D instead of recomputing
        # (over the requests the router reported it for), and why per request.
        "reused_tokens_mean": _r(sum(reused) / len(reused), 1) if reused else None,
        "reuse_reasons": dict(sorted(reasons.items())) or None,
        "send_lag_ms_max": _r(max((r.send_lag_ms for r in results), default=0.0)),
    }
    errs = sorted({r.error for r in results if r.error})
    if errs:
        out["error_samples"] = [e[:160] for e in errs[:3]]
    return {k: v for k, v in out.items() if v is not None}


def assess_sustainable(arrivals: Sequence[float], ends: Sequence[float | None], qps: float,
                       failed: int = 0) -> dict[str, Any]:
    """Did the stack keep up with the offered open-loop rate?

    `arrivals`/`ends`: send and completion times of each job (a request, or a whole
    conversation in multi-turn mode); an end of None means it never finished (timeout or
    cut off at the end of the point). Unsustainable when any job did not finish, or the
    completion rate ((n-1) / span of completions) is below SUSTAIN_MIN_RATIO x the
    achieved arrival rate, or the backlog (sent, not finished) grows over the second half
    of the arrivals by at least max(3, a quarter of those arrivals) (least-squares slope),
    or more than SUSTAIN_MAX_ERROR_FRACTION of the jobs failed. qps 0 (one at a time) is
    sustainable by construction.
    """
    n = len(arrivals)
    out: dict[str, Any] = {"sustainable": True}
    if qps <= 0 or n == 0:
        return out
    unfinished = sum(e is None for e in ends)
    if n >= 2 and arrivals[-1] > arrivals[0]:
        out["offered_qps_actual"] = round((n - 1) / (arrivals[-1] - arrivals[0]), 4)
    done = sorted(e for e in ends if e is not None)
    if len(done) >= 2 and done[-1] > done[0]:
        out["achieved_qps"] = round((len(done) - 1) / (done[-1] - done[0]), 4)
    growth = 0.0
    half = list(range(n // 2, n))
    if len(half) >= 3:
        ts = [arrivals[i] for i in half]
        backlog = [sum(a <= arrivals[i] for a in arrivals)
                   - sum(e is not None and e <= arrivals[i] for e in ends) for i in half]
        mt, mb = sum(ts) / len(ts), sum(backlog) / len(backlog)
        var = sum((t - mt) ** 2 for t in ts)
        if var > 0:
            slope = sum((t - mt) * (b - mb) for t, b in zip(ts, backlog, strict=True)) / var
            growth = slope * (ts[-1] - ts[0])
    out["backlog_growth"] = round(growth, 2)
    reasons = []
    if unfinished:
        reasons.append(f"{unfinished} unfinished")
    if failed > SUSTAIN_MAX_ERROR_FRACTION * n:
        reasons.append(f"{failed} failed")
    ratio = None
    if "achieved_qps" in out and "offered_qps_actual" in out and n >= 4:
        ratio = out["achieved_qps"] / out["offered_qps_actual"]
        if ratio < SUSTAIN_MIN_RATIO:
            reasons.append(f"completion rate {ratio:.2f}x offered")
    if len(half) >= 3 and growth >= max(3.0, 0.25 * len(half)):
        reasons.append(f"backlog +{growth:.1f}")
    if reasons:
        out["sustainable"] = False
        out["unsustainable_reason"] = "; ".join(reasons)
    return out
