"""Fleet test parts that are real processes: a `redis-server` and router replicas run by
the `kvferry router` CLI (so a test can SIGKILL one), for tests/test_router_fleet_*.py and
tests/test_fleet_engines.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import redis
from helpers_http import free_port

from kvferry.connectors.protocol.params import SECRET_ENV


def wait_for(cond: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"{what} not reached in {timeout} s"
        time.sleep(0.01)


class RedisServer:
    """One `redis-server` on a free port, no persistence; stop/start keep the port."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server missing: bash .ci/setup --tests installs it (apt: redis-server)"
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=0.5)
        wait_for(lambda: _pings(client), 10, "redis-server did not start")
        client.close()

    def stop(self) -> None:
        """SIGKILL: Redis dies the way a lost node does (no shutdown, no save)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


class RouterProcess:
    """One router replica: `python -m kvferry.scripts.cli router ARGS` on its own port
    (kept across restarts), with this test's code (PYTHONPATH is inherited) and secret."""

    def __init__(self, args: list[str], secret: str, log_path: Path) -> None:
        self.args = args
        # Every turn through P (D-local short turns off): these tests count D -> P reuse.
        self.env = {**os.environ, SECRET_ENV: secret, "KVFERRY_D_LOCAL_MAX_NEW_TOKENS": "0"}
        self.log_path = log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvferry.scripts.cli", "router", "--port",
                 str(self.port), "--log-level", "warning", *self.args],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_for(self.up, timeout, f"router on {self.url} up")

    def up(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log_path.read_text()
        try:
            return httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` with `labels` on this replica's /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=10, trust_env=False).text
        total = 0.0
        for line in text.splitlines():
            head, _, value = line.rpartition(" ")
            if (head == name or head.startswith(name + "{")) and all(
                    f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total
