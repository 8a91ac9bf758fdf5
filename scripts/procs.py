"""Child processes in their own process groups, so stopping one leaves no orphans, and
the free ports they are started on.

vLLM spawns engine-core and worker processes; signalling only the API server would leave
them behind, so every child gets a new session and is stopped with killpg.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import httpx


class Shutdown(Exception):
    """Raised from the SIGINT/SIGTERM/SIGHUP handler so `finally` blocks stop the children."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Each stops a stack the same way. SIGINT too, explicitly: a background job (`kvferry up &`)
starts with SIGINT ignored, which Python keeps, so without a handler `kill -INT` did nothing."""


def on_stop_signal(signum: int, _frame: FrameType | None) -> None:
    raise Shutdown(signal.Signals(signum).name)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Inside: each of `STOP_SIGNALS` raises `Shutdown` in the main thread, so the caller's
    `finally` stops its children (a SIGTERM otherwise ends Python without it, leaving
    engines in their own process groups running). Handlers restored on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread can take signals
        return
    old = {s: signal.signal(s, on_stop_signal) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


PORT_GAP = 8
"""Ports `free_port` hands out stay this far apart: an engine also binds port + TP rank."""

PORT_RANGE_ENV = "KVFERRY_PORT_RANGE"
"""``LO-HI``: `free_port` picks in [LO, HI) instead of 20000 up to the ephemeral range
(a host whose firewall opens a range; test runs side by side that must never pick each other's
ports, whose children bind tens of seconds after the pick)."""


def _port_range() -> tuple[int, int]:
    if spec := os.environ.get(PORT_RANGE_ENV):
        lo, _, hi = spec.partition("-")
        if not (lo.isdigit() and hi.isdigit() and 1024 <= int(lo) < int(hi) <= 65536):
            raise ValueError(f"{PORT_RANGE_ENV}={spec!r}: expected LO-HI, 1024 <= LO < HI")
        return int(lo), int(hi)
    return 20000, ephemeral_low() - PORT_GAP


def ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(taken: set[int]) -> int:
    """A TCP port free on 127.0.0.1 now, below the OS's ephemeral range (or in
    `PORT_RANGE_ENV`'s) and at least PORT_GAP away from every port in ``taken`` (to which it is added).

    Children bind it seconds later (engines: tens of seconds); an OS-picked (ephemeral)
    port can be taken by then by any process's outgoing connection or ZMQ socket (CI lost
    a run to "Address already in use" on a side channel)."""
    rng = random.Random()
    lo, hi = _port_range()
    for _ in range(1000):
        port = rng.randrange(lo, hi)
        if any(abs(port - t) < PORT_GAP for t in taken):
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        taken.add(port)
        return port
    raise RuntimeError(f"no free TCP port in [{lo}, {hi})")


class StartupError(RuntimeError):
    """A child died or never became healthy; the message includes its log tail."""


@dataclass
class Child:
    """One launched process, its log file and the URL whose /health says it is ready."""

    name: str
    argv: list[str]
    log_path: Path
    health_url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Launch with stdout+stderr written to log_path (fresh per run), in a new group."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 40) -> str:
        """Last `lines` lines of the log (for error messages)."""
        try:
            data = self.log_path.read_bytes()[-64_000:]
        except OSError:
            return "(no log)"
        return "\n".join(data.decode(errors="replace").splitlines()[-lines:])

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def group_alive(self) -> bool:
        """True while any process of the group exists (the leader may exit first)."""
        if self.proc is None:
            return False
        self.proc.poll()
        try:
            os.killpg(self.proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True


def stop_all(children: Sequence[Child], grace_s: float = 20.0) -> None:
    """SIGTERM every group, wait up to grace_s, then SIGKILL what is left."""
    for child in reversed(children):
        child.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(c.group_alive() for c in children):
        time.sleep(0.2)
    for child in children:
        if child.group_alive():
            child.signal_group(signal.SIGKILL)
        if child.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=5)


def first_dead(children: Sequence[Child]) -> Child | None:
    """A child whose main process has exited, if any."""
    return next((c for c in children if c.proc is not None and not c.alive()), None)


def died_message(child: Child) -> str:
    code = child.proc.returncode if child.proc else None
    return (f"{child.name} exited with code {code}; last lines of {child.log_path}:\n"
            f"{child.tail()}")


def wait_healthy(
    children: Sequence[Child],
    timeout_s: float,
    poll_s: float = 1.0,
    on_ready: Callable[[Child], None] | None = None,
) -> None:
    """Block until every child's /health answers 200; raise StartupError on death/timeout."""
    pending = [c for c in children if c.health_url]
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=5) as client:
        while pending:
            dead = first_dead(children)
            if dead is not None:
                raise StartupError(died_message(dead))
            for child in list(pending):
                try:
                    ok = client.get(child.health_url or "").status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    pending.remove(child)
                    if on_ready:
                        on_ready(child)
            if not pending:
                return
            if time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                tails = "\n".join(f"--- {c.name} ({c.log_path}):\n{c.tail(20)}" for c in pending)
                raise StartupError(f"not healthy after {timeout_s:.0f}s: {names}\n{tails}")
            time.sleep(poll_s)
