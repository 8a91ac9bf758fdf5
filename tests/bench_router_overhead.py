"""What the router adds to TTFT: the same streamed request straight to an engine and
through kvferry's router (pull and push), with instant fake engines (tests/helpers_http),
so all that is measured is the router's own work: parsing the body, building the legs,
sending them, relaying the stream. Real HTTP on loopback, one request at a time.

    python tests/bench_router_overhead.py --input-len 16,4096,16384 --out \
        benchmarks/results/router_overhead-cpu-DATE.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers_http import FakeEngine, serve  # noqa: E402

from kvferry.router.app import create_app  # noqa: E402
from kvferry.router.settings import RouterSettings  # noqa: E402
from kvferry.scripts.bench import git_commit  # noqa: E402


def ttft_ms(client: httpx.Client, url: str, body: dict, headers: dict) -> float:
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        for chunk in r.iter_bytes():
            if chunk:
                return (time.perf_counter() - t0) * 1e3
    raise RuntimeError("empty stream")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--input-len", default="16,4096,16384")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    commit = git_commit()[0]
    p_eng = FakeEngine("P", kv_params={"remote_engine_id": "p"})
    d_eng = FakeEngine("D", chunks=2)
    lines = []
    with ExitStack() as stack, httpx.Client(timeout=30) as client:
        p_url = stack.enter_context(serve(p_eng.app()))
        d_url = stack.enter_context(serve(d_eng.app()))
        settings = RouterSettings(prefill_urls=[p_url], decode_urls=[d_url],
                                  prefill_kv_addrs=["127.0.0.1:5600"])
        router = stack.enter_context(serve(create_app(settings, b"bench")))
        rng = random.Random(0)
        for n in map(int, args.input_len.split(",")):
            body = {"model": "tiny", "prompt": [rng.randrange(10, 150000) for _ in range(n)],
                    "max_tokens": 2, "stream": True}
            paths = {"direct": (d_url, {}), "router-pull": (router, {"x-kvferry-mode": "pull"}),
                     "router-push": (router, {"x-kvferry-mode": "push"})}
            for name, (url, hdr) in paths.items():
                ttft_ms(client, url, body, hdr)  # warm-up
                vals = sorted(ttft_ms(client, url, body, hdr) for _ in range(args.requests))
                lines.append({"experiment": "router_overhead", "target": name, "input_len": n,
                              "n": len(vals), "ttft_ms_p50": round(statistics.median(vals), 3),
                              "ttft_ms_p90": round(vals[int(0.9 * (len(vals) - 1))], 3),
                              "impl": "kvferry" if name != "direct" else "direct",
                              "mode": name.removeprefix("router-"),
                              "hardware": "cpu", "commit": commit,
                              "command": " ".join(sys.argv),
                              "date": time.strftime("%Y-%m-%d")})
                print(lines[-1], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
