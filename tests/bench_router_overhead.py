"""What the router adds to TTFT: the same streamed request straight to an engine and
through kvferry's router (pull and push), with instant fake engines (tests/helpers_http),
so all that is measured is the router's own work: parsing the body, building the legs,
sending them, relaying the stream. Real HTTP on loopback, one request at a time.

    python tests/bench_router_overhead.py --input-len 16,4096,16384 --out \
        benchmarks/results/router_overhead-cpu-DATE.jsonl

`--fleet`: the same under load, one replica against two. Fake P and D run as their own
processes, routers as `kvferry router` processes. Each round sends `--concurrency`
streaming requests at once through the replicas (one, or alternating between two) and
as many straight to D alongside them, so both see the same load; one-replica and
two-replica rounds alternate, so drift hits both alike. Router overhead, two ways: the
routed requests' TTFT p50 minus the direct ones' (the P leg plus the router's own work,
queueing included: on a busy shared host mostly waiting for a core), and the CPU time the
setting's replicas used per routed request (/proc; what a replica costs whatever else
runs). Any failed request (HTTP error, error event, no [DONE]) is counted; the run fails
unless 0. Memory state and no conversation ids: no Redis call is on the path.

    python tests/bench_router_overhead.py --fleet --concurrency 200 --rounds 5 \
        --out benchmarks/results/router_fleet-cpu-DATE.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers_http import FakeEngine, free_port, healthy, serve  # noqa: E402

from kvferry.router.api.app import create_app  # noqa: E402
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
    ap.add_argument("--fleet", action="store_true", help="one vs two replicas under load")
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    lines = fleet(args) if args.fleet else single(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    return 1 if any(line.get("errors") for line in lines) else 0


def single(args: argparse.Namespace) -> list[dict]:
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
    return lines


# -- --fleet: one replica against two, under load -------------------------------------------
async def _one(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, float] | str:
    """(TTFT, total) in ms of one streamed request, or how it failed."""
    t0 = time.perf_counter()
    ttft = None
    raw = b""
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}"
            async for chunk in r.aiter_bytes():
                if chunk and ttft is None:
                    ttft = (time.perf_counter() - t0) * 1e3
                raw += chunk
    except httpx.HTTPError as exc:
        return f"{url}: {type(exc).__name__}: {exc}"
    if ttft is None or b'"error"' in raw or not raw.rstrip().endswith(b"data: [DONE]"):
        return f"{url}: bad stream {raw[-300:]!r}"
    return ttft, (time.perf_counter() - t0) * 1e3


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds the processes used so far (/proc/PID/stat)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / os.sysconf("SC_CLK_TCK")


async def _rounds(direct: str, replicas: dict[str, list[str]], pids: dict[str, list[int]],
                  body: dict, concurrency: int, rounds: int) -> dict[str, dict[str, Any]]:
    """Per round and setting: `concurrency` requests through the setting's replicas (in
    turn) and as many straight to D, all at once, so both see the same load; and the CPU
    time the setting's replicas spent on the round."""
    # A fresh connection per request: on a starved host a server's 5 s idle close can
    # act on a kept-alive connection whose next request it has not read yet (seen with a
    # 4 s client expiry: 2 ReadErrors in 4000 requests at load 46), and httpx does not
    # retry. Every path pays the same connection set-up.
    limits = httpx.Limits(max_connections=8 * concurrency, max_keepalive_connections=0)
    got: dict[str, dict[str, Any]] = {name: {"router": [], "direct": [], "cpu_s": 0.0}
                                      for name in replicas}
    async with httpx.AsyncClient(limits=limits, timeout=120, trust_env=False) as client:
        for _ in range(rounds):
            for name, urls in replicas.items():
                via = [urls[i % len(urls)] for i in range(concurrency)]
                # An unmeasured burst first: every replica's connections (client side and
                # to the engines) are open and warm, as under steady traffic, whichever
                # setting ran before.
                for measured in (False, True):
                    cpu0 = _cpu_s(pids[name])
                    res = await asyncio.gather(*(_one(client, u, body) for pair in zip(
                        via, [direct] * concurrency, strict=True) for u in pair))
                    if measured:
                        got[name]["cpu_s"] += _cpu_s(pids[name]) - cpu0
                        got[name]["router"] += res[0::2]
                        got[name]["direct"] += res[1::2]
                    elif any(isinstance(x, str) for x in res):
                        got[name]["warmup_errors"] = got[name].get("warmup_errors", 0) + sum(
                            isinstance(x, str) for x in res)
    return got


def _p(vals: list[float], q: float) -> float:
    vals = sorted(vals)
    return round(vals[min(len(vals) - 1, int(q * len(vals)))], 3) if vals else float("nan")


def fleet(args: argparse.Namespace) -> list[dict]:
    from fleet_stack import RouterProcess, wait_for

    commit, dirty = git_commit()
    here = Path(__file__).resolve().parent
    with ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        engines = {}
        for name in ("prefill", "decode"):
            port = free_port()
            proc = subprocess.Popen([sys.executable, str(here / "helpers_http.py"), str(port),
                                     name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            stack.callback(proc.kill)
            engines[name] = f"http://127.0.0.1:{port}"
            wait_for(lambda u=engines[name]: healthy(u), 30, f"fake {name} up")
        routers = [RouterProcess(["--prefill", engines["prefill"], "--decode",
                                  engines["decode"], "--health-interval", "0"], "bench",
                                 logs / f"router-{i}.log")
                   for i in range(2)]
        for r in routers:
            stack.callback(r.kill)
            r.start()
        replicas = {"one_replica": [routers[0].url], "two_replicas": [r.url for r in routers]}
        body = {"model": "tiny", "prompt": list(range(100, 612)), "max_tokens": 3,
                "stream": True}
        pids = {name: [r.proc.pid for r in routers if r.url in urls]
                for name, urls in replicas.items()}
        load = os.getloadavg()[0]
        got = asyncio.run(_rounds(engines["decode"], replicas, pids, body, args.concurrency,
                                  args.rounds))
        load = max(load, os.getloadavg()[0])
    lines = []
    for name, paths in got.items():
        stats = {}
        for path in ("router", "direct"):
            res = paths[path]
            ok = [x for x in res if not isinstance(x, str)]
            for why in sorted({x for x in res if isinstance(x, str)})[:5]:
                print(f"{name} {path} failed: {why}", file=sys.stderr, flush=True)
            stats[path] = {"n": len(res), "errors": len(res) - len(ok),
                           "ttft_ms_p50": _p([x[0] for x in ok], 0.5),
                           "ttft_ms_p90": _p([x[0] for x in ok], 0.9),
                           "latency_ms_p50": _p([x[1] for x in ok], 0.5)}
        line = {"experiment": "router_fleet", "impl": "kvferry", "mode": "pull",
                "target": name, "replicas": len(replicas[name]),
                "upstreams": "fake (tests/helpers_http.py, own processes)", "hardware": "cpu",
                "input_len": len(body["prompt"]), "output_len": 3,
                "concurrency": args.concurrency, "rounds": args.rounds, **stats["router"],
                "overhead_ms_p50": round(stats["router"]["ttft_ms_p50"]
                                         - stats["direct"]["ttft_ms_p50"], 3),
                "router_cpu_ms_per_request": round(paths["cpu_s"] * 1e3 / len(paths["router"]),
                                                   3),
                "loadavg_1m_max": round(load, 1),
                "direct": stats["direct"], "commit": commit, "dirty": dirty,
                "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d")}
        line["errors"] += stats["direct"]["errors"] + paths.get("warmup_errors", 0)
        lines.append(line)
    one, two = lines
    two["overhead_vs_one_replica_ms"] = round(two["overhead_ms_p50"] - one["overhead_ms_p50"], 3)
    two["cpu_vs_one_replica_ms"] = round(two["router_cpu_ms_per_request"]
                                         - one["router_cpu_ms_per_request"], 3)
    for line in lines:
        print(json.dumps(line), flush=True)
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
