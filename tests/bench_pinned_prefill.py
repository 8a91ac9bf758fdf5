"""Prefill blocks pinned by requests the decode engine refuses (issue 37 item 2; a benchmark
driver, not a test).

One 1P1D stack of real CPU engines (tiny model) and the router. P's free KV blocks
(vLLM's kv_cache_usage_perc x num_gpu_blocks) are read before and after bursts of
`--burst` concurrent `--input-len`-token requests from one client:

- `invalid`: max_tokens 0, -1, 1.5 and n = -1 in turn: what D would refuse; the router
  refuses them before P (P receives none).
- `d_refuses`: logprobs above D's --max-logprobs, which only D knows: P prefills each, D
  refuses it, and the router tells P to free the offer at once (offer_release.py).
- `d_refuses_no_release`: the same with the router's release switched off, as cdd3802 did:
  P keeps each offer's blocks for send_timeout_s. Run last (its blocks stay pinned).

    flock /tmp/kvferry-engines.lock .venv/bin/python tests/bench_pinned_prefill.py
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stack import pd_stack  # noqa: E402

from kvferry.router.legs import flow, offer_release  # noqa: E402
from kvferry.scripts.modelgen import SHAPES, write_model  # noqa: E402

VOCAB = SHAPES["tiny"].vocab_size

INVALID = ({"max_tokens": 0}, {"max_tokens": -1}, {"max_tokens": 1.5}, {"n": -1})


def p_blocks(url: str) -> tuple[int, int]:
    """(free, total) KV blocks of the engine at ``url``, from its /metrics."""
    total, usage = 0, 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            total = int(float(line.split('num_gpu_blocks="')[1].split('"')[0]))
        elif line.startswith("vllm:kv_cache_usage_perc{"):
            usage = float(line.rsplit(" ", 1)[1])
    return round(total * (1.0 - usage)), total


async def burst(url: str, model: str, n: int, input_len: int, fields: Any) -> dict[str, int]:
    """``n`` concurrent requests, one client; their status codes counted."""
    rng = random.Random(n * input_len)
    codes: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=600, trust_env=False,
                                 limits=httpx.Limits(max_connections=n)) as c:
        async def one(i: int) -> None:
            body = {"model": model,
                    "prompt": [rng.randrange(10, VOCAB) for _ in range(input_len)],
                    "max_tokens": 4, **fields(i)}
            r = await c.post(url + "/v1/completions", json=body)
            codes[str(r.status_code)] = codes.get(str(r.status_code), 0) + 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return codes


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--burst", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=4000, help="prompt of the invalid burst")
    ap.add_argument("--refused-input-len", type=int, default=512, help="prompt of the bursts "
                    "P prefills (2 shared CPU cores prefill 128 x 4000 tokens past the "
                    "router's 120 s prefill timeout)")
    ap.add_argument("--results-dir", default="benchmarks/results")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    model = str(write_model(tmp / "tiny", "tiny", weights=True))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    command = "flock /tmp/kvferry-engines.lock .venv/bin/python tests/bench_pinned_prefill.py" \
        + "".join(f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                  if k != "results_dir")
    lines = []
    with pd_stack(model, tmp / "logs", decode_args=("--max-logprobs", "5")) as s:
        release = offer_release.release_soon
        cases = [
            ("invalid", args.input_len, lambda i: INVALID[i % len(INVALID)], release),
            ("d_refuses", args.refused_input_len, lambda i: {"logprobs": 10}, release),
            ("d_refuses_no_release", args.refused_input_len, lambda i: {"logprobs": 10},
             lambda ctx, offer: None),
        ]
        for name, input_len, fields, releaser in cases:
            flow.release_soon = releaser  # the pull flow's reference to it
            before, total = p_blocks(s.prefill.url)
            p_requests = s.prefill.metric("vllm:request_success_total")
            t0 = time.perf_counter()
            codes = asyncio.run(burst(s.router, s.model, args.burst, input_len, fields))
            last = time.perf_counter()
            time.sleep(1.0)
            after_1s, _ = p_blocks(s.prefill.url)
            line = {"experiment": "pinned_prefill", "impl": "kvferry", "mode": name,
                    "hardware": "cpu", "model": "tiny", "input_len": input_len,
                    "n": args.burst, "codes": codes,
                    "p_requests": s.prefill.metric("vllm:request_success_total") - p_requests,
                    "p_blocks_total": total, "p_free_blocks_before": before,
                    "p_free_blocks_1s_after_last_answer": after_1s,
                    "p_pinned_blocks": before - after_1s,
                    "burst_s": round(last - t0, 2), "command": command, "commit": commit,
                    "date": datetime.date.today().isoformat()}
            print(json.dumps(line), flush=True)
            lines.append(line)
    out = Path(args.results_dir) / f"pinned_prefill-cpu-{datetime.date.today():%Y%m%d}.jsonl"
    with out.open("a") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
