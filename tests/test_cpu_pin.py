"""scripts/cpu_pin.py on real processes: a stand-in for vLLM's worker (its process title,
its main thread moved to the last core as vLLM's NIXL worker does) is put back on the cores
its rank's bind string gives it; the engine's other processes are left alone."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from kvferry.scripts.cpu_pin import parse_ranges, restore_worker_binding, workers
from kvferry.scripts.procs import Child, stop_all

# The "engine": an API-server-like parent that starts two workers (TP ranks 0 and 1) and a
# helper process; each moves its main thread to the last CPU, as vLLM's NIXL worker does.
ENGINE = """
import os, subprocess, sys, time
last = max(os.sched_getaffinity(0))
if len(sys.argv) > 1:
    import setproctitle
    setproctitle.setproctitle(sys.argv[1])
    os.sched_setaffinity(0, {last})
    print("ready", flush=True)
    time.sleep(600)
kids = [subprocess.Popen([sys.executable, __file__, t])
        for t in ("VLLM::Worker_TP0", "VLLM::Worker_TP1", "VLLM::EngineCore")]
time.sleep(600)
"""


def test_parse_ranges() -> None:
    assert parse_ranges("0-2,5") == {0, 1, 2, 5}
    assert parse_ranges("3") == {3}
    assert parse_ranges("") == set()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to move a thread")
def test_workers_go_back_to_their_ranks_cores(tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    bind = f"{cpus[0]}|{cpus[0]}"  # both ranks on the first CPU, away from the last
    child = Child("engine", [sys.executable, str(script)], tmp_path / "engine.log",
                  env={"VLLM_CPU_OMP_THREADS_BIND": bind})
    child.start()
    try:
        deadline = time.monotonic() + 30
        while len(workers(child)) < 2 or child.log_path.read_text().count("ready") < 3:
            assert time.monotonic() < deadline, child.tail()
            time.sleep(0.1)
        ranks = workers(child)
        assert sorted(ranks.values()) == [0, 1]  # the EngineCore-titled one is no worker
        moved = restore_worker_binding(child)
        assert set(moved) == set(ranks)
        assert all(was == {cpus[-1]} for was in moved.values())
        assert all(os.sched_getaffinity(pid) == {cpus[0]} for pid in ranks)
        assert restore_worker_binding(child) == {}  # nothing left to move
    finally:
        stop_all([child], grace_s=5)
