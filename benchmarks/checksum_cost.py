"""What block checksums cost a pulled request: TTFT through a running `kvferry up` stack, and
the time each check added on D (its ``checksums_verified`` events: READ seen DONE to the
source's checksums compared), for one ``--kv-checksums`` setting of the stack.

Run it once per setting against a stack started with that setting (h200_checksums.sh does
off, sample and all back to back on one GPU); one result line each (bench schema,
``experiment: "kv_checksums"``, ``mode`` = the setting). Prompts are random token ids, one
request at a time (TTFT is the client's, to the first token of a 1-token answer).

usage: python benchmarks/checksum_cost.py --checksums all --input-len 16384 --n 20 --out F
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import httpx

from kvferry.connectors.transfer.handshake import fetch_engine_stats


def pct(xs: list[float], q: float) -> float | None:
    """None (JSON null) when nothing was measured: NaN is not JSON."""
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router", default="http://127.0.0.1:8000")
    ap.add_argument("--decode-side", default="127.0.0.1:5602", help="D's side channel")
    ap.add_argument("--checksums", required=True, choices=("off", "sample", "all"),
                    help="what the stack was started with (--kv-checksums)")
    ap.add_argument("--transfer", default="pull", choices=("pull", "push"),
                    help="how the KV moves (the router's x-kvferry-mode)")
    ap.add_argument("--input-len", type=int, default=16384)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=30000,
                    help="prompt ids are drawn below this (the tiny CPU model has 1024)")
    ap.add_argument("--model", default="qwen3-8b", help="the shape, for the result line")
    ap.add_argument("--hardware", required=True, help="e.g. h100x1, h200x1, cpu")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    host, port = a.decode_side.rsplit(":", 1)
    rng = random.Random(a.input_len)
    with httpx.Client(trust_env=False, timeout=300) as c:
        served = c.get(a.router + "/v1/models").json()["data"][0]["id"]
        before = fetch_engine_stats(host, int(port))
        ttft: list[float] = []
        for i in range(a.warmup + a.n):
            prompt = [rng.randrange(a.vocab_size // 30, a.vocab_size) for _ in range(a.input_len)]
            t0 = time.perf_counter()
            r = c.post(a.router + "/v1/completions",
                       json={"model": served, "prompt": prompt, "max_tokens": 1},
                       headers={"x-kvferry-mode": a.transfer})
            r.raise_for_status()
            if i >= a.warmup:
                ttft.append((time.perf_counter() - t0) * 1e3)
        after = fetch_engine_stats(host, int(port))
    new = after.since(before)
    checks = [float(e.detail.split()[0]) for e in new if e.name == "checksums_verified"]
    commit = os.environ.get("KVFERRY_COMMIT", "")  # the device copy's .git may be stale
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    line = {"experiment": "kv_checksums", "impl": "kvferry", "mode": a.checksums,
            "hardware": a.hardware, "model": a.model, "input_len": a.input_len, "output_len": 1,
            "qps": 0, "n": a.n, "ttft_ms_p50": pct(ttft, 0.5), "ttft_ms_p90": pct(ttft, 0.9),
            "ttft_ms_mean": round(statistics.fmean(ttft), 2),
            "checks": len(checks), "check_ms_p50": pct(checks, 0.5),
            "check_ms_p90": pct(checks, 0.9),
            "transfer": a.transfer,
            "reads_done": after["reads_done"] - before["reads_done"],
            "pushes_received": after["push_received"] - before["push_received"],
            "checksum_mismatches": after["checksum_mismatches"] - before["checksum_mismatches"],
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "commit": commit, "date": date.today().isoformat()}
    with a.out.open("a") as f:
        f.write(json.dumps(line) + "\n")
    print(json.dumps(line))


if __name__ == "__main__":
    main()
