"""A discrete-event simulation of a P/D fleet, to check `kvferry plan`'s model against
something that queues and batches request by request (pure: seeded, no I/O).

Requests arrive as a Poisson stream, with prompt and answer lengths drawn uniformly within
+-``spread`` of the load's means. The router sends each to the prefill engine that frees
up first (least queued work); a P prefills one prompt at a time at the calibrated speed;
the KV handoff takes its calibrated time per prompt token; the router then gives the
request to the decode engine holding the fewest streams. A D steps its whole batch (up to
``max_batch``) at once, each step taking ``step_ms + step_ms_per_seq * batch`` and giving
each stream one token: TTFT is a request's arrival to its first token from D, the
inter-token times are the steps between its tokens.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from .capacity import Calibration, Load


@dataclass
class _Stream:
    arrival: float
    left: int  # tokens still to emit
    first: bool = True
    measured: bool = False


@dataclass
class _Decode:
    running: list[_Stream] = field(default_factory=list)
    waiting: list[_Stream] = field(default_factory=list)
    busy: bool = False

    def size(self) -> int:
        return len(self.running) + len(self.waiting)


@dataclass(frozen=True)
class SimResult:
    """What one simulated run of a P/D split measured."""

    prefill: int
    decode: int
    requests: int  # measured (arrived after the warm-up)
    ttft_p90_s: float
    itl_p90_s: float
    mean_batch: float  # streams per decode step


def _p90(values: list[tuple[float, int]]) -> float:
    """Weighted 90th percentile of (value, weight) pairs."""
    if not values:
        return math.inf
    total = sum(w for _, w in values)
    acc = 0
    for v, w in sorted(values):
        acc += w
        if acc >= 0.9 * total:
            return v
    return values[-1][0]


def simulate(cal: Calibration, load: Load, prefill: int, decode: int, seconds: float,
             seed: int = 0, spread: float = 0.5, warmup: float = 0.2) -> SimResult:
    rng = random.Random(seed)
    events: list[tuple[float, int, str, object]] = []
    seq = 0

    def push(t: float, kind: str, data: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, data))

    def draw(mean: float) -> int:
        return max(1, round(mean * rng.uniform(1 - spread, 1 + spread)))

    t = rng.expovariate(load.qps)
    while t < seconds:
        push(t, "arrive", None)
        t += rng.expovariate(load.qps)
    p_free = [0.0] * prefill
    ds = [_Decode() for _ in range(decode)]
    ttfts: list[tuple[float, int]] = []
    itls: list[tuple[float, int]] = []
    steps = batch_sum = measured = 0
    horizon = seconds * 4 + 600  # a queue that never drains is cut off here (TTFT = inf)
    while events:
        now, _, kind, data = heapq.heappop(events)
        if now > horizon:
            break
        if kind == "arrive":
            prompt = draw(load.prompt_tokens)
            s = _Stream(now, draw(load.answer_tokens), measured=now >= warmup * seconds)
            measured += s.measured
            i = min(range(prefill), key=p_free.__getitem__)
            done = max(now, p_free[i]) + prompt / cal.prefill_tok_s + cal.prefill_fixed_ms / 1000
            p_free[i] = done
            push(done + prompt * cal.transfer_ms_per_token / 1000, "handoff", s)
        elif kind == "handoff":
            j = min(range(decode), key=lambda k: ds[k].size())
            ds[j].waiting.append(data)  # type: ignore[arg-type]
            if not ds[j].busy:
                push(now, "step", j)
        elif kind == "step":  # a step starts: admit waiting streams, schedule its end
            d = ds[data]  # type: ignore[index]
            room = cal.max_batch - len(d.running)
            d.running += d.waiting[:room]
            del d.waiting[:room]
            d.busy = bool(d.running)
            if d.busy:
                push(now + cal.step_s(len(d.running)), "end", (data, now))
        else:  # a step ends: one token per stream
            j, start = data  # type: ignore[misc]
            d = ds[j]
            gap = now - start
            later = 0
            for s in d.running:
                s.left -= 1
                if s.first:
                    s.first = False
                    if s.measured:
                        ttfts.append((now - s.arrival, 1))
                elif s.measured:
                    later += 1
            if later and now <= seconds:
                itls.append((gap, later))
            if start >= warmup * seconds and now <= seconds:
                steps += 1
                batch_sum += len(d.running)
            d.running = [s for s in d.running if s.left > 0]
            push(now, "step", j)
    ttfts += [(math.inf, 1)] * (measured - len(ttfts))  # never got a first token
    return SimResult(prefill, decode, measured, _p90(ttfts), _p90(itls),
                     batch_sum / steps if steps else 0.0)
