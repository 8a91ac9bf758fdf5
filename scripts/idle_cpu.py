"""How much CPU a decode engine burns while its request waits for KV that is slow to come.

A P and a D (vLLM CPU engines, kvferry connector) start on their own cores; D gets one
push request whose transfer id P never prefills, so D waits (up to P's register timeout).
Over a window we sample the CPU time of D's process tree (API server, engine core,
worker), once per `idle_step_wait_ms` setting, back to back in one run, and write one
JSON line per setting (../shared/bench-schema.md) to benchmarks/results/.

    python -m kvferry.scripts.idle_cpu --waits 5,0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import secrets
import shlex
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import httpx
import psutil

from kvferry.connectors.protocol.params import SECRET_ENV
from kvferry.scripts.bench import git_commit
from kvferry.scripts.engines import EngineSpec, engine_argv, engine_env
from kvferry.scripts.modelgen import write_model
from kvferry.scripts.procs import Child, free_port, stop_all, wait_healthy

_TAKEN: set[int] = set()


def _port() -> int:
    return free_port(_TAKEN)


def _engine(role: str, model: str, logs: Path, secret: str, cpu: int, extra: dict) -> tuple:
    port, side = _port(), _port()
    spec = EngineSpec(role=role, model=model, port=port, side_channel_port=side,  # type: ignore[arg-type]
                      lease_control_port=_port(), cpus=(cpu,), connector_extra=extra)
    child = Child(role, engine_argv(spec), logs / f"{role}-{port}.log",
                  f"http://127.0.0.1:{port}/health", {**engine_env(spec), SECRET_ENV: secret})
    child.start()
    return child, f"http://127.0.0.1:{port}", side


def _cpu_seconds(procs: list[psutil.Process]) -> list[float]:
    out = []
    for p in procs:
        try:
            t = p.cpu_times()
            out.append(t.user + t.system)
        except psutil.Error:
            out.append(0.0)
    return out


def measure(wait_ms: float, model: str, logs: Path, window_s: float) -> dict:
    secret = secrets.token_hex(8)
    extra = {"idle_step_wait_ms": wait_ms, "push_register_timeout_s": window_s + 30,
             "push_recv_timeout_s": window_s + 60}
    p, p_url, p_side = _engine("prefill", model, logs, secret, 0, extra)
    d, d_url, _ = _engine("decode", model, logs, secret, 1, extra)
    try:
        wait_healthy([p, d], 900)
        rnd = random.Random(0)
        body = {"model": model, "prompt": [rnd.randrange(10, 1000) for _ in range(200)],
                "max_tokens": 2, "temperature": 0}
        httpx.post(d_url + "/v1/completions", json=body, timeout=120).raise_for_status()  # warm
        params = {"do_remote_prefill": True, "push": True, "transfer_id": f"never-{wait_ms}",
                  "remote_host": "127.0.0.1", "remote_port": p_side}

        def waiting_request() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the engines are stopped under it
                httpx.post(d_url + "/v1/completions", json={**body, "kv_transfer_params": params},
                           timeout=window_s + 120)

        threading.Thread(target=waiting_request, daemon=True).start()
        time.sleep(3.0)  # D has registered and waits
        assert d.proc is not None
        root = psutil.Process(d.proc.pid)
        procs = [root, *root.children(recursive=True)]
        c0, t0 = _cpu_seconds(procs), time.monotonic()
        time.sleep(window_s)
        c1, dt = _cpu_seconds(procs), time.monotonic() - t0
        per = {}
        for proc, a, b in zip(procs, c0, c1, strict=True):
            name = proc.name() if proc.is_running() else "?"
            per[name] = round(per.get(name, 0.0) + (b - a) / dt, 3)
        return {"d_cores_waiting": round(sum(per.values()), 3), "d_cores_by_process": per}
    finally:
        stop_all([p, d])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waits", default="5,0", help="idle_step_wait_ms values, compared in one run")
    ap.add_argument("--window", type=float, default=15.0, help="seconds of CPU sampling per value")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    commit, dirty = git_commit()
    out = args.out or Path("benchmarks/results") / f"idle_cpu-cpu-{date.today():%Y%m%d}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_model(Path(tmp) / "tiny", "tiny", weights=True))
        for w in (float(x) for x in args.waits.split(",")):
            row = {"experiment": "idle_cpu", "impl": "kvferry", "mode": "push", "hardware": "cpu",
                   "model": "tiny", "idle_step_wait_ms": w, "window_s": args.window,
                   **measure(w, model, Path(tmp) / "logs", args.window),
                   "command": shlex.join(["python", "-m", "kvferry.scripts.idle_cpu", *sys.argv[1:]]),
                   "commit": commit, "commit_dirty": dirty, "date": date.today().isoformat()}
            print(json.dumps(row), flush=True)
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
