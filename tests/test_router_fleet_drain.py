"""Router fleet over real HTTP, drain: SIGTERM lets in-flight streams finish, then the
`kvferry router` process exits 0.

Fake engines (tests/helpers_http.py) answer like vLLM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import helpers_router_fleet
import httpx
from fleet_stack import wait_for
from helpers_fleet import P_PARAMS
from helpers_http import FakeEngine, free_port, serve

ROOT = Path(__file__).resolve().parent.parent

_secret = helpers_router_fleet._secret
stack = helpers_router_fleet.stack


# -- 4. drain -----------------------------------------------------------------------------------
def test_sigterm_drains_in_flight_streams_and_exits_0(stack) -> None:
    p = FakeEngine("p0", kv_params=dict(P_PARAMS))
    d = FakeEngine("d0", chunks=6, chunk_delay_s=0.2)
    purl = stack.enter_context(serve(p.app()))
    durl = stack.enter_context(serve(d.app()))
    port = free_port()
    # The caller's PYTHONPATH first (a worktree's shim), so the router run is this code.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvferry.scripts.cli", "router", "--prefill", purl,
         "--decode", durl, "--port", str(port), "--drain-timeout", "10",
         "--health-interval", "0", "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stack.callback(lambda: proc.poll() is None and proc.kill())
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/health", timeout=1, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, 30, "router up")
    got: list[bytes] = []
    started = threading.Event()

    def stream() -> None:
        body = {"prompt": "hi", "max_tokens": 6, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=20,
                          trust_env=False) as r:
            for chunk in r.iter_bytes():
                got.append(chunk)
                started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(10)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0, proc.stderr.read().decode()
    t.join(10)
    raw = b"".join(got)
    assert raw.count(b"tok") == 6 and raw.rstrip().endswith(b"data: [DONE]")
    assert not up()  # it stopped accepting
