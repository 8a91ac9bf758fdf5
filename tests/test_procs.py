"""scripts/procs.py's free_port, the one port picker of the chaos stack, idle_cpu and the
tests (helpers_http.free_port): ports free now, below the ephemeral range, 8 apart."""

from __future__ import annotations

import socket
from itertools import combinations
from pathlib import Path

import helpers_http

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
