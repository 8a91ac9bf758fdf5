"""What a host-memory tier can cost a conversation's next turn, measured with vLLM's own
CPU offloading (`--kv-offloading-size`, its `OffloadingConnector`) on one engine: the
reference for kvferry's planned host tier (docs/kv-tiers.md), not kvferry's tier.

Per history (random token ids, greedy, one at a time): the first request computes it
(`recompute`); the same prompt again hits HBM's prefix cache (`hbm_hit`); after the
engine's HBM prefix cache is reset (vLLM's dev endpoint, HBM only) it loads from the
offloaded copy in host memory (`vllm_cpu_offload`); after a reset of the offloaded copy
too it computes again (`recompute`). Every answer's tokens are compared with the first's.
One result line per (input_len, mode), bench schema, ``experiment: "kv_tiers"``.

usage (GPU machine, vLLM on PYTHONPATH): python benchmarks/offload_probe.py --model-dir DIR
    --hardware h100x1 --out F [--offload-gib 8] [--lens 8192,24576] [--n 5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import httpx

PORT = 8300
URL = f"http://127.0.0.1:{PORT}"
METRIC = re.compile(r"^(vllm:[a-z_]*(?:prefix_cache|offload|connector|external)[a-z_]*)"
                    r"(\{[^}]*\})? ([0-9.eE+-]+)$")


def counters() -> dict[str, float]:
    """The engine's prefix-cache and connector counters, summed over labels."""
    out: dict[str, float] = {}
    for line in httpx.get(URL + "/metrics", timeout=10).text.splitlines():
        m = METRIC.match(line)
        if m and not m.group(1).endswith(("_created", "_bucket")):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 3) for k, v in after.items()
            if v != before.get(k, 0.0)}


def turn(model: str, prompt: list[int], out_len: int) -> tuple[float, list[int]]:
    """(TTFT ms, output token ids) of one streamed greedy completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "min_tokens": out_len,
            "temperature": 0, "stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    ttft, out = float("nan"), []
    with httpx.stream("POST", URL + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:]).get("choices", []):
                ids = ch.get("token_ids") or []
                if ids and not out:
                    ttft = (time.perf_counter() - t0) * 1e3
                out += ids
    return ttft, out


def reset(external: bool) -> None:
    """Empty HBM's prefix cache (and, with `external`, the offloaded copy); retried while
    blocks are still held by a finishing request."""
    for _ in range(100):
        r = httpx.post(URL + "/reset_prefix_cache",
                       params={"reset_external": "true"} if external else None, timeout=30)
        r.raise_for_status()
        if r.json()["success"]:
            return
        time.sleep(0.1)
    raise RuntimeError("prefix cache still busy")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--hardware", required=True)
    ap.add_argument("--offload-gib", type=float, default=8.0)
    ap.add_argument("--lens", default="8192,24576")
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--out-len", type=int, default=16)
    ap.add_argument("--gpu-util", type=float, default=0.6)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--log", type=Path, default=Path("offload_probe_engine.log"))
    a = ap.parse_args()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", a.model_dir,
           "--load-format", "dummy", "--skip-tokenizer-init", "--port", str(PORT),
           "--max-model-len", "32768", "--gpu-memory-utilization", str(a.gpu_util),
           "--kv-offloading-size", str(a.offload_gib), "--served-model-name", a.shape]
    with open(a.log, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                sys.exit(f"engine exited {proc.returncode}; see {a.log}")
            try:
                if httpx.get(URL + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > 400:
                sys.exit("engine did not start in 400 s")
            time.sleep(1)
        print(f"engine up in {time.monotonic() - t0:.0f} s", flush=True)
        turn(a.shape, list(range(100, 612)), 4)  # compile and warm paths, not measured
        rows = []
        commit = os.environ.get("KVFERRY_COMMIT", "unknown")
        for n_in in map(int, a.lens.split(",")):
            ttft: dict[str, list[float]] = {"recompute": [], "hbm_hit": [],
                                            "vllm_cpu_offload": []}
            match: dict[str, bool] = dict.fromkeys(ttft, True)
            hits: dict[str, float] = {}
            for i in range(a.n):
                rnd = random.Random(n_in * 1000 + i)
                prompt = [rnd.randrange(1000, 150000) for _ in range(n_in)]
                reset(external=True)
                t, ref = turn(a.shape, prompt, a.out_len)
                ttft["recompute"].append(t)
                time.sleep(1.0)  # the offloading store of the finished request completes
                t, out = turn(a.shape, prompt, a.out_len)
                ttft["hbm_hit"].append(t)
                match["hbm_hit"] &= out == ref
                time.sleep(0.5)
                reset(external=False)
                before = counters()
                t, out = turn(a.shape, prompt, a.out_len)
                for k, v in delta(before, counters()).items():
                    hits[k] = hits.get(k, 0.0) + v
                ttft["vllm_cpu_offload"].append(t)
                match["vllm_cpu_offload"] &= out == ref
                reset(external=True)
                t, out = turn(a.shape, prompt, a.out_len)
                ttft["recompute"].append(t)
                match["recompute"] &= out == ref
                print(n_in, i, {k: round(v[-1], 1) for k, v in ttft.items()}, flush=True)
            for mode, xs in ttft.items():
                row = {"experiment": "kv_tiers", "impl": "vllm-offloading", "mode": mode,
                       "hardware": a.hardware, "model": a.shape, "input_len": n_in,
                       "output_len": a.out_len, "qps": 0, "n": len(xs),
                       "ttft_ms_p50": round(statistics.median(xs), 2),
                       "ttft_ms_p90": pct(xs, 0.9), "outputs_match": match[mode],
                       "offload_gib": a.offload_gib,
                       "command": "python benchmarks/offload_probe.py " + " ".join(sys.argv[1:]),
                       "commit": commit, "date": date.today().isoformat()}
                if mode == "vllm_cpu_offload":
                    row["engine_counters_delta"] = hits
                rows.append(row)
                print(json.dumps(row), flush=True)
        with open(a.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
