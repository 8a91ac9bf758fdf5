"""Stress loop for test_e2e_2p2d's spread scenario: many rounds on one 2P2D stack.

Run through the engine lock, e.g.
``flock /tmp/kvf-engine.lock env PYTHONPATH=$PWD/.shim .venv/bin/python
tests/chaos/stress_2p2d.py --minutes 6``. Each round sends the six concurrent requests of
``_spread`` (three pulls, three pushes) and records, per round, D's READs and P's WRITEs,
which (P, D) each pull used, and every WARNING line the engines and the router wrote.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
os.environ.setdefault("KVFERRY_TIMELINE", "1")

from stack import (  # noqa: E402
    STARTUP_S,
    Engine,
    outputs_differ,
    prompt,
    serve_kvferry_router,
    start_engine,
    warm_up,
)
from test_e2e_2p2d import EXTRA, SHARED_CORES, Cluster, send, total  # noqa: E402

from kvferry.scripts.engines import available_cpus  # noqa: E402
from kvferry.scripts.procs import stop_all, wait_healthy  # noqa: E402


def start(es: ExitStack, logs: Path, warm: bool, one_core: bool = False) -> Cluster:
    import secrets

    from kvferry.scripts.modelgen import write_model

    model = str(write_model(logs / "model", "tiny", weights=True))
    secret = secrets.token_hex(16)
    cpus = available_cpus()
    if one_core:  # all four engines on one core: a slower, busier CI runner
        p_cpus, d_cpus = (cpus[0], cpus[0]), (cpus[0], cpus[0])
    elif SHARED_CORES:
        p_cpus, d_cpus = (cpus[0], cpus[-1]), (cpus[-1], cpus[0])
    else:
        p_cpus, d_cpus = (cpus[0], cpus[1]), (cpus[2], cpus[3])
    children: list = []
    es.callback(stop_all, children)

    def one(role: str, cpu: int, args: tuple[str, ...] = ()) -> Engine:
        e = start_engine(role, model, logs, secret, extra=EXTRA, cpus=(cpu,), engine_args=args)
        children.append(e.child)
        return e

    ps = [one("prefill", c, ("--no-enable-prefix-caching",)) for c in p_cpus]
    ds = [one("decode", c) for c in d_cpus]
    wait_healthy(children, STARTUP_S)
    if warm:
        warm_up(ps + ds, model)
    return Cluster(ps, ds, serve_kvferry_router(es, ps, ds, secret), model)


def _dump_when_slow(c: Cluster, after_s: float, done: threading.Event) -> None:
    """Diagnosis: a round slower than ``after_s`` gets every engine process's Python
    stacks written to its log (SIGUSR2; needs a sitecustomize that registers faulthandler
    for it on the engines' PYTHONPATH)."""
    if after_s <= 0 or done.wait(after_s):
        return
    for e in c.engines:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(e.child.proc.pid, signal.SIGUSR2)
    print(f"round slower than {after_s}s: stacks dumped", flush=True)


def round_(c: Cluster, seed: int, router_log: Path, dump_after: float = 0.0) -> dict:
    jobs = [(n, "pull" if i % 2 == 0 else "push") for i, n in
            enumerate((200, 700, 129, 400, 500, 300))]
    toks = {n: prompt(n, seed + n) for n, _ in jobs}
    reads0 = total(c.decodes, Engine.reads)
    writes0 = total(c.prefills, Engine.writes)
    marks = [len(e.log().splitlines()) for e in c.engines]
    rmark = len(router_log.read_text().splitlines())
    t0 = time.monotonic()
    done = threading.Event()
    threading.Thread(target=_dump_when_slow, args=(c, dump_after, done), daemon=True).start()
    with ThreadPoolExecutor(len(jobs)) as pool:
        futs = {n: pool.submit(send, c, toks[n], mode) for n, mode in jobs}
        got = {n: f.result() for n, f in futs.items()}
    done.set()
    took = time.monotonic() - t0
    time.sleep(1.0)
    out = {"seed": seed, "s": round(took, 1),
           "reads": int(total(c.decodes, Engine.reads) - reads0),
           "writes": int(total(c.prefills, Engine.writes) - writes0),
           "pairs": {n: [mode, got[n][1].get("x-kvferry-prefill", "")[-5:],
                         got[n][1].get("x-kvferry-decode", "")[-5:],
                         got[n][1].get("x-kvferry-transfer", "")] for n, mode in jobs},
           "warnings": [f"{e.role}:{e.url[-5:]}: {ln[:300]}" for e, m in
                        zip(c.engines, marks, strict=True)
                        for ln in e.log().splitlines()[m:] if "WARNING" in ln or "ERROR" in ln],
           "router": [ln[:300] for ln in router_log.read_text().splitlines()[rmark:]
                      if "WARNING" in ln or "ERROR" in ln]}
    if any(outputs_differ(got[n][0], c.colocated(toks[n])) for n, _ in jobs):
        out["wrong"] = True
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument("--logs", type=Path, default=Path("/tmp/kvf-stress"))
    ap.add_argument("--no-warm", action="store_true")
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--dump-after", type=float, default=0.0,
                    help="seconds after which a round dumps the engines' stacks (SIGUSR2)")
    ap.add_argument("--one-core", action="store_true", help="pin all four engines to one core")
    a = ap.parse_args()
    a.logs.mkdir(parents=True, exist_ok=True)
    router_log = a.logs / "router.log"
    router_log.write_text("")
    logging.basicConfig(filename=router_log, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t_start = time.monotonic()
    with ExitStack() as es:
        c = start(es, a.logs, not a.no_warm, a.one_core)
        print(f"cluster up in {time.monotonic() - t_start:.0f}s: "
              f"P {[p.url for p in c.prefills]} D {[d.url for d in c.decodes]}", flush=True)
        deadline = time.monotonic() + a.minutes * 60
        seed = a.seed
        while time.monotonic() < deadline:
            r = round_(c, seed, router_log, a.dump_after)
            print(json.dumps(r), flush=True)
            seed += 4000


if __name__ == "__main__":
    main()
