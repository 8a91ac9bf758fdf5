"""Router data plane benchmark (issue 33): streamed load straight to D, through kvferry's
router and through vllm-router (the Rust peer, `pip install .[bench]`), one run, back to
back against the same engines, with each router's CPU time per 1,000 streamed chunks
read from /proc (robust to other load on the machine; wall-clock numbers are not).

CPU machine (FAKE engines, benchmarks/fake_engine.py, started here; each router under
test pinned to core 0, engines and this client on the other cores):

    .venv/bin/python benchmarks/router_dataplane.py

Real engines (e.g. after `kvferry up --hardware-backend cuda --share-device 30`): point
it at them; kvferry's router is the one at --kvferry (or started here when omitted),
vllm-router is started here against the same P and D:

    .venv/bin/python benchmarks/router_dataplane.py --hardware h200 --no-pin \
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \
        --kvferry http://127.0.0.1:8000

`--overload`: kvferry alone at 4x its admission capacity (`--max-active`), then at half
its capacity: refused requests by status (429/503 are refusals, 502/504 failures), whether
every refusal carried Retry-After, and whether the second phase ran without errors
(recovered by itself). One JSON line per (impl, concurrency) is appended to
benchmarks/results/router_dataplane-<hardware>-<YYYYMMDD>.jsonl (shared/bench-schema.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

HERE = Path(__file__).resolve().parent
EVENT = b"data: {"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    """Until `url` answers any HTTP status (the server is up)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up in {timeout_s:.0f} s")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its children so far."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def listener_pids(url: str) -> list[int]:
    """The pids listening on `url`'s port on this host (a router we did not start; its
    SO_REUSEPORT workers each listen)."""
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    return sorted({c.pid for c in psutil.net_connections("tcp")
                   if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   and c.pid})


def router_root(pids: list[int]) -> int | None:
    """The process whose tree holds all of `pids`: the one listener, or the parent that
    forked the workers (`cpu_s` counts it and its children)."""
    if len(pids) <= 1:
        return pids[0] if pids else None
    parents = {psutil.Process(p).ppid() for p in pids}
    return parents.pop() if len(parents) == 1 else None


@dataclass
class Phase:
    """What the clients saw during one measured phase."""

    ttft_ms: list[float] = field(default_factory=list)
    gaps_ms: list[float] = field(default_factory=list)
    chunks: int = 0
    ok: int = 0
    statuses: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    refused_without_retry_after: int = 0

    def add(self, other: Phase) -> None:
        """Another round of the same target, as if measured in one piece."""
        self.ttft_ms += other.ttft_ms
        self.gaps_ms += other.gaps_ms
        self.chunks += other.chunks
        self.ok += other.ok
        self.statuses.update(other.statuses)
        self.errors += other.errors
        self.refused_without_retry_after += other.refused_without_retry_after


async def one_stream(session: aiohttp.ClientSession, url: str, body: dict, ph: Phase
                     ) -> float:
    """One streamed request; returns how long to wait before the next (Retry-After)."""
    t0 = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                ph.statuses[r.status] += 1
                text = (await r.read())[:200]
                if r.status in (429, 503):
                    ra = r.headers.get("retry-after")
                    if ra is None:
                        ph.refused_without_retry_after += 1
                    return min(float(ra or 1), 1.0)
                ph.errors.append(f"HTTP {r.status}: {text!r}")
                return 0.0
            last = None
            tail = b""
            done = False
            async for data in r.content.iter_any():
                n = (tail + data).count(EVENT)
                tail = data[-(len(EVENT) - 1):]
                if b"[DONE]" in data:
                    done = True
                if n:
                    now = time.perf_counter()
                    if last is None:
                        ph.ttft_ms.append((now - t0) * 1e3)
                    else:
                        ph.gaps_ms.append((now - last) * 1e3)
                    last = now
                    ph.chunks += n
                if b'"error"' in data:
                    ph.errors.append(f"error event: {data[:200]!r}")
            if not done:
                ph.errors.append("stream ended without [DONE]")
            else:
                ph.ok += 1
            ph.statuses[200] += 1
    except (TimeoutError, aiohttp.ClientError) as exc:
        ph.errors.append(f"{type(exc).__name__}: {exc}")
        ph.statuses["transport"] += 1
    return 0.0


async def load(url: str, concurrency: int, duration_s: float, body: dict) -> tuple[Phase, float]:
    """`concurrency` clients streaming back to back for `duration_s` (requests running at
    the end finish); (what they saw, wall seconds)."""
    ph = Phase()
    deadline = time.perf_counter() + duration_s
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=600, sock_read=120)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def worker(i: int) -> None:
            await asyncio.sleep(i * 0.002)  # streams start spread, as clients arrive
            while time.perf_counter() < deadline:
                wait = await one_stream(session, url, {**body, "user": str(i)}, ph)
                if wait:
                    await asyncio.sleep(wait)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        return ph, time.perf_counter() - t0


def pct(vals: list[float], q: float) -> float | None:
    if not vals:
        return None
    vals = sorted(vals)
    return round(vals[min(len(vals) - 1, int(q * len(vals)))], 2)


@dataclass
class Target:
    impl: str
    url: str
    pid: int | None
    workers: int = 1
    """Router processes serving the port."""


class Bench:
    """Starts what the run needs (fake engines, routers) and tears it down."""

    def __init__(self, args: argparse.Namespace, stack: ExitStack) -> None:
        self.args = args
        self.stack = stack
        ncpu = os.cpu_count() or 2
        self.router_cpus = None if args.no_pin else args.router_cpu
        others = sorted(set(range(ncpu)) - {int(c) for c in (self.router_cpus or "").split(",")
                                            if c})
        self.other_cpus = ",".join(map(str, others)) if self.router_cpus and others else None
        if self.other_cpus:
            os.sched_setaffinity(0, others)

    def popen(self, cmd: list[str], pin: str | None, log: str,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        if pin:
            cmd = ["taskset", "-c", pin, *cmd]
        out = open(Path(self.args.log_dir) / log, "wb")  # noqa: SIM115
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.stack.callback(_stop, proc)
        return proc

    def engines(self) -> tuple[str, str]:
        a = self.args
        if a.prefill and a.decode:
            return a.prefill, a.decode
        urls = []
        for role in ("prefill", "decode"):
            port = free_port()
            proc = self.popen([sys.executable, str(HERE / "fake_engine.py"), str(port),
                               "--interval-ms", str(a.interval_ms)], self.other_cpus,
                              f"fake-{role}.log")
            urls.append(f"http://127.0.0.1:{port}")
            wait_http(urls[-1] + "/health", 30, proc)
        return urls[0], urls[1]

    def kvferry(self, p: str, d: str) -> Target:
        a = self.args
        if a.kvferry:
            pids = listener_pids(a.kvferry)
            return Target("kvferry", a.kvferry, router_root(pids), len(pids))
        port = free_port()
        kv = shutil.which("kvferry", path=str(Path(sys.executable).parent)) or "kvferry"
        cmd = [kv, "router", "--prefill", p, "--decode", d, "--port", str(port),
               "--health-interval", "0", *a.kvferry_arg]
        proc = self.popen(cmd, self.router_cpus, "kvferry-router.log")
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", 60, proc)
        return Target("kvferry", url, proc.pid, len(listener_pids(url)))

    def kvferry_like(self, base: Target, workers: int) -> Target:
        """Another kvferry router with `base`'s command line and environment (read from
        /proc: the same engines, connector settings and secret) but `workers` worker
        processes, on a port of its own: one run compares worker counts on the same
        engines (`--impls kvferry,kvferry@4`)."""
        assert base.pid is not None, "the kvferry router's pid is unknown"
        root = psutil.Process(base.pid)
        cmd, env = root.cmdline(), root.environ()
        port = free_port()
        cmd = with_option(with_option(cmd, "--port", str(port)), "--workers", str(workers))
        proc = self.popen(cmd, self.router_cpus, f"kvferry-router-w{workers}.log", env)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", 60, proc)
        return Target("kvferry", url, proc.pid, len(listener_pids(url)))

    def vllm_router(self, p: str, d: str) -> Target:
        port = free_port()
        exe = self.args.vllm_router or shutil.which(
            "vllm-router", path=str(Path(sys.executable).parent)) or "vllm-router"
        cmd = [exe, "--vllm-pd-disaggregation", "--prefill", p, "--decode", d,
               "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
               "--log-level", "warning", "--health-check-interval-secs", "3600"]
        proc = self.popen(cmd, self.router_cpus, "vllm-router.log")
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", 120, proc)
        return Target("vllm-router", url, proc.pid)


def with_option(cmd: list[str], name: str, value: str) -> list[str]:
    """`cmd` with option `name` set to `value` (replaced where given, else appended)."""
    out, i = [], 0
    while i < len(cmd):
        if cmd[i] == name:
            i += 2
            continue
        if cmd[i].startswith(name + "="):
            i += 1
            continue
        out.append(cmd[i])
        i += 1
    return [*out, name, value]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def model_of(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/v1/models") as r:
        data = await r.json(content_type=None)
    try:
        return data["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        return "fake"


def git_commit() -> str:
    """KVFERRY_COMMIT when set (a copied tree, as on the GPU machine, has no or a stale .git)."""
    if os.environ.get("KVFERRY_COMMIT"):
        return os.environ["KVFERRY_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=HERE, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def line(args: argparse.Namespace, t: Target, conc: int, ph: Phase, wall: float,
         cpu: float | None, extra: dict[str, Any]) -> dict[str, Any]:
    errors = len(ph.errors) + sum(n for s, n in ph.statuses.items()
                                  if s not in (200, 429, 503))
    return {
        "experiment": "router_dataplane", "impl": t.impl, "hardware": args.hardware,
        "engines": "fake (benchmarks/fake_engine.py)" if not args.decode else "real",
        "concurrency": conc, "input_len": args.input_len, "output_len": args.output_len,
        "duration_s": round(wall, 2), "requests": ph.ok, "chunks": ph.chunks,
        "tokens_per_s": round(ph.chunks / wall, 1) if wall else None,
        "itl_ms_p50": pct(ph.gaps_ms, 0.5), "itl_ms_p99": pct(ph.gaps_ms, 0.99),
        "ttft_ms_p50": pct(ph.ttft_ms, 0.5), "ttft_ms_p99": pct(ph.ttft_ms, 0.99),
        "errors": errors,
        "router_cpu_ms_per_1k_chunks": (round(cpu * 1e6 / ph.chunks, 2)
                                        if cpu is not None and ph.chunks else None),
        "router_cpu_cores": round(cpu / wall, 3) if cpu is not None and wall else None,
        "router_pinned_cpus": args.router_cpu if not args.no_pin else None,
        "router_workers": t.workers if t.impl != "direct" else None,
        "statuses": {str(k): v for k, v in sorted(ph.statuses.items(), key=str)},
        "refused_429_503": ph.statuses[429] + ph.statuses[503],
        "failed_502_504": ph.statuses[502] + ph.statuses[504],
        "refused_without_retry_after": ph.refused_without_retry_after,
        **extra,
        "command": " ".join(sys.argv), "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d"),
    }


async def phase(args: argparse.Namespace, t: Target, conc: int, body: dict
                ) -> tuple[Phase, float, float | None]:
    """One measured phase of `t`: (what the clients saw, wall s, router CPU s or None)."""
    await load(t.url, min(conc, 8), 1.0, body)  # warm: connections open, code paths hot
    c0 = cpu_s(t.pid) if t.pid else None
    ph, wall = await load(t.url, conc, args.duration, body)
    cpu = cpu_s(t.pid) - c0 if t.pid and c0 is not None else None
    return ph, wall, cpu


async def measure(args: argparse.Namespace, t: Target, conc: int, body: dict,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    ph, wall, cpu = await phase(args, t, conc, body)
    return report(args, t, conc, ph, wall, cpu, extra)


def report(args: argparse.Namespace, t: Target, conc: int, ph: Phase, wall: float,
           cpu: float | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    out = line(args, t, conc, ph, wall, cpu, extra or {})
    for why in sorted(set(ph.errors))[:5]:
        print(f"  {t.impl} c={conc}: {why}", file=sys.stderr)
    print(json.dumps({k: v for k, v in out.items() if k not in ("command",)}), flush=True)
    return out


async def run(args: argparse.Namespace, bench: Bench) -> list[dict[str, Any]]:
    p, d = bench.engines()
    model = args.model or await model_of(d)
    words = max(1, args.input_len - 8)
    body = {"model": model, "prompt": f"{uuid.uuid4().hex} " + "hello " * words,
            "max_tokens": args.output_len, "stream": True, "ignore_eos": True,
            "temperature": 0}
    targets = {"direct": lambda: Target("direct", d, None),
               "kvferry": lambda: bench.kvferry(p, d),
               "vllm-router": lambda: bench.vllm_router(p, d)}
    out = []
    if args.overload:
        t = bench.kvferry(p, d)
        over = 4 * args.max_active
        out.append(await measure(args, t, over, body, {"mode": "overload",
                                                       "capacity": args.max_active}))
        rec = await measure(args, t, max(1, args.max_active // 2), body,
                            {"mode": "after_overload", "capacity": args.max_active})
        rec["recovered"] = rec["errors"] == 0 and rec["requests"] > 0
        out.append(rec)
        return out
    started: list[Target] = []
    for name in args.impls.split(","):
        if name.startswith("kvferry@"):  # the kvferry router again, with N workers
            base = next((t for t in started if t.impl == "kvferry"), None) or bench.kvferry(p, d)
            started.append(bench.kvferry_like(base, int(name.split("@", 1)[1])))
        else:
            started.append(targets[name]())
    for conc in map(int, args.concurrency.split(",")):
        # Rounds interleave the targets, each round in another order, so that a machine
        # drifting during the run (a noisy GPU host) weighs on every target alike.
        got: dict[int, tuple[Phase, float, float | None]] = {}
        for r in range(args.rounds):
            k = r % len(started)
            for t in started[k:] + started[:k]:
                ph, wall, cpu = await phase(args, t, conc, body)
                if id(t) in got:
                    ph0, wall0, cpu0 = got[id(t)]
                    ph0.add(ph)
                    cpu = cpu0 + cpu if cpu0 is not None and cpu is not None else None
                    ph, wall = ph0, wall0 + wall
                got[id(t)] = (ph, wall, cpu)
        for t in started:
            out.append(report(args, t, conc, *got[id(t)],
                              {"rounds": args.rounds} if args.rounds > 1 else None))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="64,256")
    ap.add_argument("--impls", default="direct,kvferry,vllm-router",
                    help="targets, comma-separated: direct, kvferry, vllm-router, and "
                    "kvferry@N (the kvferry router's command line again with --workers N)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per target")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure each target this many times, interleaved and each round "
                    "in another order; a row sums its target's rounds")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--interval-ms", type=float, default=20.0,
                    help="fake D: ms between a stream's tokens")
    ap.add_argument("--prefill", help="real prefill engine URL (no fakes)")
    ap.add_argument("--decode", help="real decode engine URL (no fakes)")
    ap.add_argument("--kvferry", help="a running kvferry router (else one is started)")
    ap.add_argument("--kvferry-arg", action="append", default=[],
                    help="extra `kvferry router` argument (repeat)")
    ap.add_argument("--vllm-router", help="vllm-router executable (default: the venv's)")
    ap.add_argument("--model", help="model name (default: D's /v1/models)")
    ap.add_argument("--hardware", default="cpu")
    ap.add_argument("--router-cpu", default="0", help="taskset CPU list for routers")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the routers")
    ap.add_argument("--overload", action="store_true")
    ap.add_argument("--max-active", type=int, default=64,
                    help="--overload: the router's admission capacity (its --max-active)")
    ap.add_argument("--log-dir", default="/tmp")
    ap.add_argument("--out", help="JSONL file (default benchmarks/results/"
                    "router_dataplane-<hardware>-<YYYYMMDD>.jsonl)")
    args = ap.parse_args()
    if args.overload and not args.kvferry:
        args.kvferry_arg += ["--max-active", str(args.max_active)]
    out = Path(args.out or HERE / "results" /
               f"router_dataplane-{args.hardware}-{time.strftime('%Y%m%d')}.jsonl")
    import uvloop

    with ExitStack() as stack:
        lines = uvloop.run(run(args, Bench(args, stack)))
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for ln in lines:
            f.write(json.dumps(ln) + "\n")
    print(f"wrote {len(lines)} lines to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
