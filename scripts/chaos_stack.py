"""The chaos run's stack: two prefill and two decode vLLM CPU engines with kvferry's
connector and the router, each in its own process group, so that any of them can be
SIGKILLed and started again on the same address (ports, side channel, lease channel).

Engines are started with the builders `kvferry up` uses (scripts/engines.py). The router
runs as its own process (``kvferry router``), so that it can be killed too; its state is
in memory, so a killed router forgets its conversations (their leases end by TTL on D).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvferry.connectors.transfer.faults import ENV as FAULTS_ENV
from kvferry.connectors.transfer.faults import TAG_ENV as FAULTS_TAG_ENV
from kvferry.connectors.transfer.handshake import HandshakeError, fetch_engine_stats

from .engines import EngineSpec, available_cpus, engine_argv, engine_env
from .procs import Child, free_port, stop_all, wait_healthy

CHAOS_EXTRA: dict[str, Any] = {
    # Short enough that every fault settles inside a run, long enough for two shared
    # cores: P frees unread blocks after 30 s, D gives up a READ after 20 s, a push
    # waits at most 30 s for its other half, a lease lives 40 s unless renewed.
    "handshake_timeout_s": 10, "recv_timeout_s": 20, "send_timeout_s": 30,
    "push_hold_timeout_s": 20, "push_register_timeout_s": 30, "push_recv_timeout_s": 30,
    "push_quarantine_s": 2, "decoder_kv_blocks_ttl": 40, "lease_free_grace_s": 4,
    "lease_margin_s": 3, "reuse_read_timeout_s": 2,
    # Every READ is checked: the corrupt fault's flipped bytes must all be caught.
    "kv_checksums": "all",
}
# The transfer counters the books add up over every incarnation of every engine.
CHECKSUM_COUNTERS = ("corruptions_injected", "checksum_mismatches", "checksums_verified",
                     "checksums_unanswered", "checksums_unchecked")
MAX_MODEL_LEN = 2048
ROUTER_TIMEOUTS = {"prefill": 60.0, "decode": 90.0}  # per wait for bytes, each leg


def settle_bound_s(extra: dict[str, Any] = CHAOS_EXTRA) -> float:
    """How long after the last request every block must be free again: the longest hold
    of the connector's timeouts (a lease whose router died lives its TTL plus the free
    grace; an unread offer is freed after send_timeout_s; a push destination after
    push_recv_timeout_s plus quarantine), plus a margin for two busy cores."""
    holds = (extra["decoder_kv_blocks_ttl"] + extra["lease_free_grace_s"],
             extra["send_timeout_s"], extra["push_register_timeout_s"],
             extra["push_recv_timeout_s"] + extra["push_quarantine_s"])
    return max(holds) + 30.0


@dataclass
class Proc:
    """One engine or the router: how to start it again, and what happened to it."""

    name: str  # p0, p1, d0, d1, router
    role: str  # prefill, decode, router
    url: str
    argv: list[str]
    env: dict[str, str]
    logs: Path
    side_port: int = 0
    control_port: int = 0
    child: Child | None = None
    incarnation: int = 0
    kills: int = 0
    crashes: list[str] = field(default_factory=list)  # deaths nobody asked for
    killed: set[int] = field(default_factory=set)  # incarnations killed on purpose
    counted: Counter = field(default_factory=Counter)  # CHECKSUM_COUNTERS of killed incarnations

    def start(self) -> None:
        self.incarnation += 1
        self.child = Child(self.name, self.argv, self.logs / f"{self.name}-{self.incarnation}.log",
                           self.url + "/health", self.env)
        self.child.start()

    def kill(self) -> None:
        """SIGKILL the whole group (API server, engine core, workers) and reap it."""
        self.killed.add(self.incarnation)
        self.kills += 1
        self.counted.update(self.counters())  # what this incarnation counted, before it goes
        if self.child is not None:
            self.child.signal_group(signal.SIGKILL)
            deadline = time.monotonic() + 30
            while self.child.group_alive() and time.monotonic() < deadline:
                time.sleep(0.1)

    def counters(self) -> Counter:
        """This incarnation's CHECKSUM_COUNTERS (engines; empty if it does not answer)."""
        if not self.side_port:
            return Counter()
        try:
            snap = fetch_engine_stats("127.0.0.1", self.side_port, 1, timeout_s=5.0)
        except HandshakeError:
            return Counter()
        return Counter({k: snap[k] for k in CHECKSUM_COUNTERS})

    def alive(self) -> bool:
        return self.child is not None and self.child.alive()

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def pid(self) -> int | None:
        return self.child.proc.pid if self.child and self.child.proc else None


class ChaosStack:
    """2 P + 2 D + router on loopback; with fewer than 4 cores both P share the first
    core and both D the last (as tests/test_e2e_2p2d.py does), P engines without prefix caching."""

    def __init__(self, model: str, logs: Path, secret: str, plan: Path | None,
                 ucx_tls: str | None = None, extra: dict[str, Any] | None = None) -> None:
        self.model, self.logs, self.secret, self.plan = model, logs, secret, plan
        self.extra = {**CHAOS_EXTRA, **(extra or {})}
        cpus = available_cpus()
        if len(cpus) < 4:
            # No P shares a core with a D: engines that move KV between them on one core
            # stall their first transfers for seconds (tests/stack.py, CORE_RULE).
            layout = [("p0", cpus[0]), ("p1", cpus[0]), ("d0", cpus[-1]), ("d1", cpus[-1])]
        else:
            layout = [("p0", cpus[0]), ("p1", cpus[1]), ("d0", cpus[2]), ("d1", cpus[3])]
        taken: set[int] = set()
        self.engines: list[Proc] = []
        for name, cpu in layout:
            role = "prefill" if name[0] == "p" else "decode"
            port, side, ctl = free_port(taken), free_port(taken), free_port(taken)
            spec = EngineSpec(role=role, model=model, port=port, side_channel_port=side,  # type: ignore[arg-type]
                              lease_control_port=ctl, cpus=(cpu,), connector_extra=self.extra,
                              max_model_len=MAX_MODEL_LEN, ucx_tls=ucx_tls,
                              extra_args=("--no-enable-prefix-caching",) if role == "prefill" else ())
            env = {**engine_env(spec), "KVFERRY_SECRET": secret, **self._faults_env(name)}
            self.engines.append(Proc(name, role, f"http://127.0.0.1:{port}", engine_argv(spec),
                                     env, logs, side, ctl))
        rport = free_port(taken)
        argv = [sys.executable, "-m", "kvferry.scripts.cli", "router", "--port", str(rport),
                "--prefill", ",".join(p.url for p in self.prefills),
                "--decode", ",".join(d.url for d in self.decodes),
                "--prefill-kv", ",".join(f"127.0.0.1:{p.side_port}" for p in self.prefills),
                "--decode-control", ",".join(f"127.0.0.1:{d.control_port}" for d in self.decodes),
                "--prefill-timeout", str(ROUTER_TIMEOUTS["prefill"]),
                "--decode-timeout", str(ROUTER_TIMEOUTS["decode"]),
                "--health-interval", "2", "--log-level", "warning"]
        self.router = Proc("router", "router", f"http://127.0.0.1:{rport}", argv,
                           {"KVFERRY_SECRET": secret, **self._faults_env("router")}, logs)
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def _faults_env(self, tag: str) -> dict[str, str]:
        return {FAULTS_ENV: str(self.plan), FAULTS_TAG_ENV: tag} if self.plan else {}

    @property
    def prefills(self) -> list[Proc]:
        return [e for e in self.engines if e.role == "prefill"]

    @property
    def decodes(self) -> list[Proc]:
        return [e for e in self.engines if e.role == "decode"]

    @property
    def procs(self) -> list[Proc]:
        return [*self.engines, self.router]

    def start(self, timeout_s: float) -> None:
        for p in self.engines:
            p.start()
        wait_healthy([p.child for p in self.engines if p.child], timeout_s)
        self.router.start()
        wait_healthy([self.router.child], 60)  # type: ignore[list-item]
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="chaos-watch")
        self._watcher.start()

    def restart(self, p: Proc, timeout_s: float, pause_s: float = 0.0) -> float:
        """Kill ``p`` and start it again on the same address; seconds until healthy."""
        p.kill()
        time.sleep(pause_s)
        t0 = time.monotonic()
        p.start()
        wait_healthy([p.child], timeout_s)  # type: ignore[list-item]
        return time.monotonic() - t0

    def _watch(self) -> None:
        """Record every death nobody asked for (a crash), once per incarnation."""
        seen: set[tuple[str, int]] = set()
        while not self._watch_stop.wait(1.0):
            for p in self.procs:
                key = (p.name, p.incarnation)
                if p.child is None or p.incarnation in p.killed or key in seen or p.alive():
                    continue
                if p.child.proc is not None and p.child.proc.returncode is not None:
                    seen.add(key)
                    p.crashes.append(f"{p.child.log_path.name}: exit {p.child.proc.returncode}")

    def checksum_counts(self) -> Counter:
        """CHECKSUM_COUNTERS summed over every engine incarnation of the run."""
        total: Counter = Counter()
        for e in self.engines:
            total.update(e.counted)
            total.update(e.counters())
        return total

    def kv_usage(self, p: Proc) -> float | None:
        """vLLM's ``vllm:kv_cache_usage_perc`` of an engine (None if it does not answer)."""
        try:
            text = httpx.get(p.url + "/metrics", timeout=10).text
        except httpx.HTTPError:
            return None
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                   if ln.startswith("vllm:kv_cache_usage_perc"))

    def router_rss_mb(self) -> float | None:
        pid = self.router.pid()
        if pid is None:
            return None
        with contextlib.suppress(OSError, ValueError, IndexError):
            for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
                if ln.startswith("VmRSS:"):
                    return int(ln.split()[1]) / 1024
        return None

    def router_metric(self, name: str) -> float | None:
        try:
            text = httpx.get(self.router.url + "/metrics", timeout=10).text
        except httpx.HTTPError:
            return None
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                   if ln.startswith(name) and not ln.startswith("#"))

    def stop(self) -> None:
        self._watch_stop.set()
        stop_all([p.child for p in self.procs if p.child is not None])

