"""How many prefill and decode engines hold a TTFT and an inter-token SLO for a load: the
model behind `kvferry plan` (pure: no I/O; calibration in capacity_calibrate.py, the
simulation that checks it in capacity_sim.py).

Prefill: each P works through the prompts sent to it at ``prefill_tok_s`` (plus a fixed
cost per prompt), so the role is an M/D/c queue: its wait is Erlang C's, with the
exponential tail of an M/M/c wait halved for deterministic service. TTFT p90 = that wait
+ a p90 prompt's prefill and KV transfer + D's first step.

Decode: a D steps its whole batch at once, a step taking ``step_ms + step_ms_per_seq * b``.
By Little's law a D given ``q`` requests/s of ``n`` tokens each holds
``b = q n t(b)`` streams, so ``b = q n a / (1 - q n c)`` (none if ``q n c >= 1``: the
batch grows without bound); its p90 batch is the Poisson one, ``b + 1.28 sqrt(b)``, and the
p90 inter-token time is ``t(b90)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

Z90 = 1.2816  # the standard normal's 90th percentile


@dataclass(frozen=True)
class Calibration:
    """One engine's speeds, measured (capacity_calibrate.py says from which rows)."""

    prefill_tok_s: float  # prompt tokens one prefill engine computes per second
    prefill_fixed_ms: float  # per prompt, whatever its length
    step_ms: float  # a decode step with an empty batch
    step_ms_per_seq: float  # what each stream in the batch adds to a step
    transfer_ms_per_token: float  # P -> D handoff, per prompt token
    max_batch: int = 256  # vLLM's --max-num-seqs
    source: str = ""

    def step_s(self, batch: float) -> float:
        return (self.step_ms + self.step_ms_per_seq * batch) / 1000


@dataclass(frozen=True)
class Load:
    """The offered load a plan is for: rate and mean request shape."""

    qps: float
    prompt_tokens: float  # mean per request
    answer_tokens: float  # mean per request
    label: str = ""
    prompt_tokens_p90: float | None = None  # None: every prompt is the mean

    @property
    def long_prompt(self) -> float:
        return self.prompt_tokens_p90 or self.prompt_tokens


@dataclass(frozen=True)
class Slo:
    """The p90 targets a plan must hold (seconds)."""

    ttft_s: float  # p90
    itl_s: float  # p90


@dataclass
class Estimate:
    """What the model says one P/D split does under a load."""

    prefill: int
    decode: int
    ttft_p90_s: float  # inf: the prefill queue grows without bound
    itl_p90_s: float  # inf: the decode batch does
    decode_batch: float  # mean streams per decode engine
    prefill_util: float

    def holds(self, slo: Slo) -> bool:
        return self.ttft_p90_s <= slo.ttft_s and self.itl_p90_s <= slo.itl_s


@dataclass
class Recommendation:
    """The split `plan` recommends, whether it fits the engine budget, and why."""

    estimate: Estimate
    fits: bool  # within the engine budget
    reasons: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """P per D."""
        return self.estimate.prefill / self.estimate.decode


def erlang_c(servers: int, offered: float) -> float:
    """Probability an arrival waits in an M/M/c queue with ``offered`` = lambda / mu."""
    if offered >= servers:
        return 1.0
    term, total = 1.0, 1.0
    for k in range(1, servers):
        term *= offered / k
        total += term
    last = term * offered / servers / (1 - offered / servers)
    return last / (total + last)


def decode_batch(cal: Calibration, load: Load, engines: int) -> float:
    """Mean streams per decode engine (inf when the batch cannot settle)."""
    tokens_s = load.qps / engines * load.answer_tokens  # tokens/s one D must emit
    grow = tokens_s * cal.step_ms_per_seq / 1000
    if grow >= 1:
        return math.inf
    return tokens_s * cal.step_ms / 1000 / (1 - grow)


def itl_p90(cal: Calibration, load: Load, engines: int) -> tuple[float, float]:
    """(p90 inter-token seconds, mean batch) of ``engines`` decode engines."""
    b = decode_batch(cal, load, engines)
    b90 = b + Z90 * math.sqrt(b) if math.isfinite(b) else math.inf
    if b90 > cal.max_batch:
        return math.inf, b
    return cal.step_s(b90), b


def ttft_p90(cal: Calibration, load: Load, engines: int, itl_s: float) -> tuple[float, float]:
    """(p90 TTFT seconds, utilisation) of ``engines`` prefill engines."""
    service = load.prompt_tokens / cal.prefill_tok_s + cal.prefill_fixed_ms / 1000
    offered = load.qps * service
    util = offered / engines
    if util >= 1:
        return math.inf, util
    wait_p90 = 0.0
    waits = erlang_c(engines, offered)
    if waits > 0.1:  # P(W > t) = C exp(-(c mu - lambda) t); deterministic service: half
        wait_p90 = math.log(waits / 0.1) / (engines / service - load.qps) / 2
    # a p90 prompt's own prefill and handoff on top of the p90 wait (conservative)
    long = load.long_prompt
    prefill = long / cal.prefill_tok_s + cal.prefill_fixed_ms / 1000
    return wait_p90 + prefill + long * cal.transfer_ms_per_token / 1000 + itl_s, util


def max_streams(cal: Calibration, slo: Slo) -> int:
    """The largest mean batch whose p90 step still meets the inter-token SLO (0: none)."""
    fits = [b for b in range(1, cal.max_batch + 1)
            if b + Z90 * math.sqrt(b) <= cal.max_batch and cal.step_s(b + Z90 * math.sqrt(b)) <= slo.itl_s]
    return fits[-1] if fits else 0


def estimate(cal: Calibration, load: Load, prefill: int, decode: int) -> Estimate:
    itl, batch = itl_p90(cal, load, decode)
    ttft, util = ttft_p90(cal, load, prefill, itl if math.isfinite(itl) else cal.step_s(0))
    return Estimate(prefill, decode, ttft, itl, batch, util)


def recommend(cal: Calibration, load: Load, slo: Slo, budget: int | None = None,
              most: int = 64) -> Recommendation:
    """The fewest decode engines that hold the inter-token SLO, then the fewest prefill
    engines that hold TTFT with them; with a ``budget`` of engines, the split of it that
    misses the SLOs least when the fewest do not fit."""
    reasons = [f"load: {load.qps:g} req/s, {load.prompt_tokens:.0f} prompt + "
               f"{load.answer_tokens:.0f} answer tokens per request"
               f" = {load.qps * load.prompt_tokens:,.0f} prompt tok/s to prefill, "
               f"{load.qps * load.answer_tokens:,.0f} tok/s to decode",
               f"one P prefills {cal.prefill_tok_s:,.0f} tok/s (+{cal.prefill_fixed_ms:.0f} ms "
               f"a prompt); a D step takes {cal.step_ms:.2f} + {cal.step_ms_per_seq:.3f} ms "
               f"per stream; handoff {cal.transfer_ms_per_token * 1000:.2f} ms per 1k tokens"]
    d = next((n for n in range(1, most + 1) if itl_p90(cal, load, n)[0] <= slo.itl_s), None)
    if d is None:
        reasons.append(f"no decode count up to {most} holds ITL p90 <= {slo.itl_s * 1000:.0f} ms "
                       f"(a lone stream already steps in {cal.step_ms:.1f} ms?)")
        d = most
    itl, batch = itl_p90(cal, load, d)
    reasons.append(f"decode: {d} engine(s) -> {batch:.1f} streams each, ITL p90 "
                   f"{itl * 1000:.1f} ms <= {slo.itl_s * 1000:.0f} ms"
                   + (f" ({d - 1} would give {itl_p90(cal, load, d - 1)[0] * 1000:.1f} ms)"
                      if d > 1 else ""))
    b_max = max_streams(cal, slo)
    if b_max:
        reasons.append(f"a D holds ITL p90 <= {slo.itl_s * 1000:.0f} ms up to ~{b_max} streams: "
                       f"the autoscaler's target (launch --target k8s --scale-decode-running "
                       f"{b_max})")
    p = next((n for n in range(1, most + 1)
              if estimate(cal, load, n, d).ttft_p90_s <= slo.ttft_s), None)
    if p is None:
        reasons.append(f"no prefill count up to {most} holds TTFT p90 <= {slo.ttft_s * 1000:.0f} ms")
        p = most
    est = estimate(cal, load, p, d)
    reasons.append(f"prefill: {p} engine(s) at {est.prefill_util:.0%} busy -> TTFT p90 "
                   f"{est.ttft_p90_s * 1000:.0f} ms <= {slo.ttft_s * 1000:.0f} ms"
                   + (f" ({p - 1} would give {estimate(cal, load, p - 1, d).ttft_p90_s * 1000:.0f} ms)"
                      if p > 1 else ""))
    if budget is None or p + d <= budget:
        if budget is not None:
            reasons.append(f"{p + d} of the {budget} engines; spare ones go where the SLO is "
                           "tighter")
            est = _spread(cal, load, slo, est, budget)
        return Recommendation(est, True, reasons)
    best = min((estimate(cal, load, n, budget - n) for n in range(1, budget)),
               key=lambda e: max(e.ttft_p90_s / slo.ttft_s, e.itl_p90_s / slo.itl_s))
    reasons.append(f"needs {p + d} engines, {budget} given: the split missing least is "
                   f"{best.prefill}P:{best.decode}D")
    return Recommendation(best, False, reasons)


def _spread(cal: Calibration, load: Load, slo: Slo, est: Estimate, budget: int) -> Estimate:
    """Give each spare engine to the role whose SLO has the least headroom."""
    while est.prefill + est.decode < budget:
        more_p = estimate(cal, load, est.prefill + 1, est.decode)
        more_d = estimate(cal, load, est.prefill, est.decode + 1)
        est = min((more_p, more_d), key=lambda e: max(e.ttft_p90_s / slo.ttft_s,
                                                      e.itl_p90_s / slo.itl_s))
    return est
