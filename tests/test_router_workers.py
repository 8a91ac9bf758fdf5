"""Several router worker processes on one port (router/api/workers.py): real `kvferry router
--workers 2` processes, sharing conversations through a real Redis or (without --state)
the SQLite file the parent makes, FAKE engines (tests/helpers_http.py). Both workers
serve, SIGTERM drains them and exits 0, and the shared file is gone after."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from fleet_stack import RouterProcess, wait_for
from helpers_http import free_port, healthy
from helpers_router_fleet import fresh_redis, redis_server  # noqa: F401

from kvferry.router.api import workers
from kvferry.router.settings import RouterSettings

HERE = Path(__file__).resolve().parent


def test_workers_count_is_checked() -> None:
    memory = RouterSettings(prefill_urls=["http://p"], decode_urls=["http://d"])
    assert "at least 1" in (workers.check(memory, 0) or "")
    assert workers.check(memory, 1) is None and workers.check(memory, 4) is None


@pytest.mark.parametrize("shared", ["redis", "sqlite"])
def test_two_workers_share_the_port_and_drain(shared: str, request: pytest.FixtureRequest,
                                              tmp_path: Path) -> None:
    state = []
    if shared == "redis":
        state = ["--state", request.getfixturevalue("fresh_redis").url]
    files_before = set(workers.state_dir().glob("kvferry-router-*"))
    engines = []
    procs = []
    try:
        for name in ("prefill", "decode"):
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, str(HERE / "helpers_http.py"),
                                           str(port), name], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
            engines.append(f"http://127.0.0.1:{port}")
            # The fake is a Python process: beside the engine tests its imports take seconds,
            # and with probes off (--health-interval 0) the router would send to a closed port.
            wait_for(lambda u=engines[-1]: healthy(u), 60, f"fake {name} up")
        router = RouterProcess(["--prefill", engines[0], "--decode", engines[1],
                                "--health-interval", "0", "--workers", "2", *state],
                               "test", tmp_path / "router.log")
        router.start()
        assert router.proc is not None
        kids = psutil.Process(router.proc.pid).children()
        assert len(kids) == 2
        made = set(workers.state_dir().glob("kvferry-router-*")) - files_before
        assert len(made) == (1 if shared == "sqlite" else 0)
        cpu0 = [k.cpu_times().user + k.cpu_times().system for k in kids]
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True}
        for _ in range(60):  # a fresh connection each: the kernel spreads them
            with httpx.Client(trust_env=False, timeout=30) as c:
                r = c.post(router.url + "/v1/completions", json=body)
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        used = [k.cpu_times().user + k.cpu_times().system - c0 for k, c0 in zip(kids, cpu0,
                                                                               strict=True)]
        assert all(u > 0 for u in used), used  # both workers served requests
        router.proc.send_signal(signal.SIGTERM)
        assert router.proc.wait(timeout=30) == 0
        time.sleep(0.2)
        assert not any(k.is_running() and k.status() != psutil.STATUS_ZOMBIE for k in kids)
        assert not any(m.exists() for m in made)  # the shared file went with the workers
    finally:
        for p in procs:
            p.kill()
            p.wait()
