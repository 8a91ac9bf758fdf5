"""scripts/procs.py's free_port, the one port picker of the chaos stack, idle_cpu and the
tests (helpers_http.free_port): ports free now, below the ephemeral range, 8 apart."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import helpers_http
import pytest

from kvferry.scripts import procs


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_free_ports_are_bindable_below_the_ephemeral_range_and_apart() -> None:
    taken: set[int] = set()
    ports = [procs.free_port(taken) for _ in range(50)]
    assert taken == set(ports) and len(taken) == 50
    assert all(20000 <= p < _ephemeral_low() - procs.PORT_GAP for p in ports)
    assert procs.PORT_GAP == 8  # an engine binds port + TP rank (tests/stack.py: TP <= 8)
    assert all(abs(a - b) >= procs.PORT_GAP for a, b in combinations(ports, 2))
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_the_tests_picker_keeps_its_ports_apart_process_wide() -> None:
    a, b = helpers_http.free_port(), helpers_http.free_port()
    assert {a, b} <= helpers_http._GIVEN and abs(a - b) >= procs.PORT_GAP


def test_a_port_range_from_the_environment_bounds_the_picks(monkeypatch) -> None:
    """KVFERRY_PORT_RANGE: .ci/test's two pytest runs, and what they start, pick in ranges of
    their own, so the unit run never takes a port an engine is about to bind."""
    import pytest

    monkeypatch.setenv(procs.PORT_RANGE_ENV, "24000-25000")
    taken: set[int] = set()
    ports = [procs.free_port(taken) for _ in range(10)]
    assert all(24000 <= p < 25000 for p in ports)
    for bad in ("24000", "100-200", "25000-24000", "a-b"):
        monkeypatch.setenv(procs.PORT_RANGE_ENV, bad)
        with pytest.raises(ValueError, match=procs.PORT_RANGE_ENV):
            procs.free_port(set())


DRIVER = """
import sys, time
from pathlib import Path
from kvferry.scripts.procs import Child, stop_all, stop_on_signals
child = Child("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], Path(sys.argv[1]))
with stop_on_signals():
    try:
        child.start()
        print(child.proc.pid, flush=True)
        time.sleep(60)
    finally:
        stop_all([child], grace_s=5)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_stops_the_children_of_a_background_run(tmp_path, sig) -> None:
    """`kvferry soak` / `chaos` / `up` run in the background (SIGINT ignored, as a shell's
    `&` starts them): the signal still runs their `finally`, so no engine is left behind."""
    drv = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path / "log")],
                           stdout=subprocess.PIPE, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert drv.stdout is not None
    pid = int(drv.stdout.readline())
    os.kill(pid, 0)  # the child runs, in its own process group
    drv.send_signal(sig)
    assert drv.wait(timeout=20) != 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
