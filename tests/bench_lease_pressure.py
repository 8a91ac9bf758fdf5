"""Leases under memory pressure, benchmark driver (issue 17 item 3; a benchmark, not a test).

One 1P1D stack of real CPU engines whose D has a small KV cache (--d-blocks), two routers
in front of it: `reuse_on` (conversations leased on D: P reads their history back, or D
serves a short turn itself) and `reuse_off` (no lease-control addresses: no leases, every
turn recomputed). `kvferry bench` drives many concurrent multi-turn conversations through
each in turn, same prompts, and writes the JSON lines (TTFT, throughput, reused tokens)
to --results-dir. With more conversations than D holds, leases must yield (D releases the
least recently used ones before a request waits, and P checks a lease before reading it),
so leases on must never be worse than off, and better where the cache holds.

    python tests/bench_lease_pressure.py --qps 0.5,2 --num-requests 16
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers_http import serve  # noqa: E402
from stack import pd_stack  # noqa: E402

from kvferry.router.api.app import create_app  # noqa: E402
from kvferry.router.settings import RouterSettings  # noqa: E402
from kvferry.scripts.modelgen import write_model  # noqa: E402


def d_stats(url: str) -> dict[str, float]:
    """vLLM's preemption and prefix-cache counters of D."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for name in ("vllm:num_preemptions_total", "vllm:prefix_cache_hits_total",
                     "vllm:prefix_cache_queries_total"):
            if line.startswith(name):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-blocks", type=int, default=64, help="D's KV cache, 128-token blocks")
    ap.add_argument("--qps", default="0.5,2", help="conversation arrival rates")
    ap.add_argument("--num-requests", type=int, default=16, help="conversations per point")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--turn-growth", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--results-dir", default="benchmarks/results")
    ap.add_argument("--extra", default="{}", help="connector extra config (JSON) of both engines")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    model = str(write_model(tmp / "tiny", "tiny", weights=True))
    with pd_stack(model, tmp / "logs", extra=json.loads(args.extra),
                  prefill_args=("--no-enable-prefix-caching",),
                  decode_args=("--num-gpu-blocks-override", str(args.d_blocks))) as s:
        off = RouterSettings(prefill_urls=[s.prefill.url], decode_urls=[s.decode.url],
                             prefill_kv_addrs=[f"127.0.0.1:{s.prefill.side_port}"])
        with serve(create_app(off, s.secret.encode())) as off_url:
            before = d_stats(s.decode.url)
            cmd = [sys.executable, "-m", "kvferry.scripts.cli", "bench",
                   "--target", f"reuse_off={off_url},mode=reuse_off",
                   "--target", f"reuse_on={s.router},mode=reuse_on",
                   "--same-prompts", "--turns", str(args.turns),
                   "--input-len", str(args.input_len), "--turn-growth", str(args.turn_growth),
                   "--output-len", str(args.output_len), "--qps", args.qps,
                   "--num-requests", str(args.num_requests), "--experiment", "lease_pressure",
                   "--hardware", "cpu", "--model-name", "tiny", "--no-progress",
                   "--results-dir", args.results_dir]
            print("+", " ".join(cmd), flush=True)
            rc = subprocess.run(cmd, check=False).returncode
            after = d_stats(s.decode.url)
        early = [ln for ln in s.decode.log().splitlines() if "released early" in ln]
        print("D:", {k: after.get(k, 0) - before.get(k, 0) for k in after},
              f"lease releases under pressure: {len(early)} batches", flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
