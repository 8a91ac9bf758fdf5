"""The load a fleet is under, from two scrapes of its Prometheus metrics ``seconds`` apart
(pure: text in, Load out): requests/s from the routers' ``kvferry_router_requests_total``
(else the prefill engines' ``vllm:request_success_total``), mean and p90 prompt tokens from
the prefill engines' ``vllm:request_prompt_tokens`` histogram, mean answer tokens from the
decode engines' ``vllm:request_generation_tokens``. Counters are summed over every source
of a role (one text per router or engine) and differenced, so a restart between the
scrapes (a counter going down) is refused rather than read as a negative load.
"""

from __future__ import annotations

import math
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

from .capacity import Load

ROLES = ("router", "prefill", "decode")


class MetricsError(ValueError):
    """Two scrapes a load cannot be derived from (too close, a counter reset, no traffic)."""


def _samples(texts: list[str]) -> dict[str, float]:
    """name{le=...} -> value summed over sources (other labels summed away)."""
    out: dict[str, float] = defaultdict(float)
    for text in texts:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = s.name + (f"|{float(s.labels['le'])}" if "le" in s.labels else "")
                out[key] += s.value
    return out


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    if name not in after:
        return None
    d = after[name] - before.get(name, 0.0)
    if d < 0:
        raise MetricsError(f"{name} went down between the scrapes (a restart?): scrape again")
    return d


def _histogram(before: dict[str, float], after: dict[str, float],
               base: str) -> tuple[float, float, float] | None:
    """(count, mean, p90 bucket bound) of what a histogram observed between the scrapes."""
    count, total = _delta(before, after, f"{base}_count"), _delta(before, after, f"{base}_sum")
    if not count or total is None:
        return None
    buckets = sorted((float(k.split("|")[1]), _delta(before, after, k) or 0.0)
                     for k in after if k.startswith(f"{base}_bucket|"))
    p90 = next((le for le, n in buckets if n >= 0.9 * count and math.isfinite(le)), total / count)
    return count, total / count, p90


def load_from_scrapes(before: dict[str, list[str]], after: dict[str, list[str]],
                      seconds: float) -> Load:
    """``before``/``after``: role -> the texts of that role's sources."""
    if seconds <= 0:
        raise MetricsError("the scrapes must be some seconds apart")
    b = {r: _samples(before.get(r, [])) for r in ROLES}
    a = {r: _samples(after.get(r, [])) for r in ROLES}
    reqs = _delta(b["router"], a["router"], "kvferry_router_requests_total")
    if reqs is None:
        reqs = _delta(b["prefill"], a["prefill"], "vllm:request_success_total")
    prompt = _histogram(b["prefill"], a["prefill"], "vllm:request_prompt_tokens")
    answer = _histogram(b["decode"], a["decode"], "vllm:request_generation_tokens")
    missing = [what for what, v in (("requests (router or prefill)", reqs),
                                    ("prompt tokens (prefill)", prompt),
                                    ("answer tokens (decode)", answer)) if not v]
    if missing:
        raise MetricsError("no traffic seen between the scrapes for: " + ", ".join(missing))
    assert reqs and prompt and answer
    return Load(reqs / seconds, prompt[1], answer[1], f"observed over {seconds:g} s",
                prompt_tokens_p90=max(prompt[2], prompt[1]))
