"""Stress loop for test_e2e_2p2d's spread scenario: many rounds on one 2P2D stack.

Run through the engine lock, e.g.
``flock /tmp/kvf-engine.lock env PYTHONPATH=$PWD/.shim .venv/bin/python
tests/chaos/stress_2p2d.py --minutes 6``. Each round sends the six concurrent requests of
``_spread`` (helpers_2p2d.SPREAD_JOBS: three pulls, three pushes) and records, per round,
D's READs and P's WRITEs (their counters), which (P, D) each pull used, and every WARNING
line the engines and the router wrote. The stack is test_e2e_2p2d's (helpers_2p2d).
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

from helpers_2p2d import SPREAD_JOBS, Cluster, send, start_cluster  # noqa: E402
from stack import outputs_differ, prompt, stats_of  # noqa: E402


def start(es: ExitStack, logs: Path, warm: bool, one_core: bool = False) -> Cluster:
    import secrets

    from kvferry.scripts.modelgen import write_model

    model = str(write_model(logs / "model", "tiny", weights=True))
    return start_cluster(es, model, logs, secrets.token_hex(16), warm=warm, one_core=one_core)


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
    jobs = SPREAD_JOBS
    toks = {n: prompt(n, seed + n) for n, _ in jobs}
    reads0 = stats_of(c.decodes)["reads_done"]
    writes0 = stats_of(c.prefills)["writes_done"]
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
           "reads": stats_of(c.decodes)["reads_done"] - reads0,
           "writes": stats_of(c.prefills)["writes_done"] - writes0,
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
