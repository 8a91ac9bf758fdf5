"""The test-only fault hooks (connectors/transfer/faults.py): off without a plan, and with
one they drop, delay and hold exactly what the plan says, at the real transport's and
lease channel's seams (two real NIXL agents in this process; the router's lease client
through the wiring `kvferry router` does)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch

from kvferry.connectors.memory.backends import CpuBackend
from kvferry.connectors.transfer import faults, lease_control
from kvferry.connectors.transfer.transport import Transfer, Transport
from kvferry.router.conversations import lease_control as router_lease
from kvferry.scripts import cli

pytestmark = pytest.mark.timeout(120)


def plan(tmp_path: Path, rules: list[dict], seed: int = 7) -> Path:
    p = tmp_path / "plan.json"
    p.write_text(json.dumps({"seed": seed, "events": str(tmp_path / "ev"), "rules": rules}))
    return p


@pytest.fixture
def active(monkeypatch, tmp_path):
    """Turn the hooks on in this process with a plan the test rewrites."""
    path = tmp_path / "plan.json"
    monkeypatch.setattr(faults, "RELOAD_S", 0.0)
    monkeypatch.setattr(faults, "ACTIVE", True)
    monkeypatch.setattr(faults, "_PLAN", faults._Plan(str(path), "t"))

    def set_rules(rules: list[dict], seed: int = 7) -> None:
        plan(tmp_path, rules, seed)
        os.utime(path, (time.time() + 1, time.time() + 1))  # a new mtime, even in one tick

    return set_rules


def events(tmp_path: Path) -> list[dict]:
    return [json.loads(ln) for f in sorted((tmp_path / "ev").glob("*.jsonl"))
            for ln in f.read_text().splitlines()]


def test_off_unless_the_environment_names_a_plan():
    env = {k: v for k, v in os.environ.items() if k != faults.ENV}
    code = ("from kvferry.connectors.transfer import faults as f; "
            "print(f.ACTIVE, f._PLAN, f.lost('notify'), f.held(1, 'DONE'), f.kept('notif_in', [1]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "None", "False", "DONE", "[1]"]


def test_on_with_a_plan_in_the_environment(tmp_path):
    p = plan(tmp_path, [{"point": "notify", "action": "drop", "p": 1.0}])
    env = {**os.environ, faults.ENV: str(p), faults.TAG_ENV: "d0"}
    code = "from kvferry.connectors.transfer import faults as f; print(f.ACTIVE, f.lost('notify'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["True", "True"]
    assert [(e["tag"], e["point"], e["action"]) for e in events(tmp_path)] == [("d0", "notify", "drop")]


def test_drop_delay_and_chance(active, tmp_path):
    active([{"point": "notify", "action": "drop", "p": 1.0}])
    assert faults.lost("notify") and not faults.lost("post")
    active([{"point": "post", "action": "delay", "p": 1.0, "s": 0.2}])
    t0 = time.monotonic()
    assert not faults.lost("post")
    assert time.monotonic() - t0 >= 0.2
    with pytest.raises(faults.InjectedFault):
        active([{"point": "peer_add", "action": "drop"}])
        faults.fail("peer_add")
    active([{"point": "notif_in", "action": "drop", "p": 0.0}])
    assert faults.kept("notif_in", [b"a", b"b"]) == [b"a", b"b"]
    active([])
    assert not faults.lost("notify")
    assert [e["point"] for e in events(tmp_path)] == ["notify", "post", "peer_add"]


def test_decisions_replay_for_the_same_seed_and_tag(tmp_path):
    plan(tmp_path, [{"point": "notify", "action": "drop", "p": 0.5}], seed=11)

    def run(tag: str) -> list[bool]:
        p = faults._Plan(str(tmp_path / "plan.json"), tag)
        return [p.draw("notify") is not None for _ in range(40)]

    assert run("d0") == run("d0")
    assert run("d0") != run("p1")  # each process draws its own sequence
    assert 5 < sum(run("d0")) < 35


def test_held_reports_done_late(active):
    active([{"point": "done_hold", "action": "delay", "p": 1.0, "s": 0.3}])
    x = object()
    t0 = time.monotonic()
    assert faults.held(x, "DONE") == "PROC"
    assert faults.held(x, "ERR") == "ERR"  # only a success is held
    while faults.held(x, "DONE") == "PROC":
        time.sleep(0.02)
    assert time.monotonic() - t0 >= 0.3


def test_lease_channel_hooks(active, monkeypatch, tmp_path):
    blob = b"not msgpack"
    assert lease_control.handle(None, blob, key=b"k") == {"ok": False, "error": "bad_request"}
    active([{"point": "lease_handle", "action": "drop", "p": 1.0}])
    assert lease_control.handle(None, blob, key=b"k") == {"ok": False, "error": "unreachable"}
    active([{"point": "lease_call", "action": "drop", "p": 1.0}])
    # The router's client meets the hook once `kvferry router` wired it (as in a chaos
    # run); dropped before any socket is used: nothing listens on port 1.
    monkeypatch.setattr(router_lease, "fault_hook", None)
    cli.wire_router_faults()
    got = asyncio.run(router_lease.call(("127.0.0.1", 1), "info", "x", key=b"k"))
    assert got == {"ok": False, "error": "unreachable"}
    assert [e["point"] for e in events(tmp_path)][-1:] == ["lease_call"]


def test_router_lease_calls_meet_no_hook_without_a_plan(monkeypatch):
    monkeypatch.setattr(faults, "ACTIVE", False)
    monkeypatch.setattr(router_lease, "fault_hook", None)
    cli.wire_router_faults()
    assert router_lease.fault_hook is None


_KEEP: list[torch.Tensor] = []  # registered KV must outlive its agent


def _transport(name: str) -> Transport:
    kv = torch.zeros(2, 8, 4, 2, 8)
    _KEEP.append(kv)
    return Transport(CpuBackend().describe({"kv": kv}, 8, 4), name=name)


def _peer_main(conn) -> None:  # the other agent, in a spawned child (NIXL wants one per process)
    tr = _transport("kvferry-faults-peer")
    conn.send((tr.metadata(), tr.layout.to_wire()))
    peer = tr.add_peer("us", *_unwire(conn.recv()))
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            break
        if cmd == "notifs":
            conn.send(_notifs(tr, args[0]))
        elif cmd == "notify":
            tr.notify(peer, args[0])
            conn.send("ok")
    tr.close()


def _unwire(msg: tuple) -> tuple:
    from kvferry.connectors.memory.backends import KVLayout

    meta, wire = msg
    return meta, KVLayout.from_wire(wire)


@pytest.fixture(scope="module")
def agents():
    """(our transport, the peer as we know it, a pipe to the peer process)."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_peer_main, args=(child,), daemon=True)
    proc.start()
    assert conn.poll(60), "the peer process did not start its NIXL agent"
    us = _transport("kvferry-faults-us")
    peer = us.add_peer("peer", *_unwire(conn.recv()))
    conn.send((us.metadata(), us.layout.to_wire()))
    yield us, peer, conn
    conn.send(("stop",))
    proc.join(10)
    if proc.is_alive():
        proc.kill()
    us.close()


def _notifs(tr: Transport, timeout: float = 5.0) -> list[bytes]:
    deadline, got = time.monotonic() + timeout, []
    while time.monotonic() < deadline and not got:
        got = tr.notifications()
        time.sleep(0.01)
    return got


def _ask(conn, *cmd):
    conn.send(cmd)
    assert conn.poll(30), f"the peer did not answer {cmd[0]}"
    return conn.recv()


def test_transport_hooks(agents, active):
    us, peer, conn = agents
    us.notify(peer, b"plain")
    assert _ask(conn, "notifs", 5.0) == [b"plain"]
    active([{"point": "notify", "action": "drop", "p": 1.0}])
    us.notify(peer, b"lost")
    assert _ask(conn, "notifs", 1.0) == []
    active([{"point": "notif_in", "action": "drop", "p": 1.0}])
    _ask(conn, "notify", b"lost on arrival")
    assert _notifs(us, 1.0) == []
    active([{"point": "post", "action": "drop", "p": 1.0}])
    with pytest.raises(faults.InjectedFault):
        us.start("READ", peer, [0], [1])
    active([{"point": "peer_add", "action": "drop", "p": 1.0}])
    with pytest.raises(faults.InjectedFault):
        us.add_peer("peer2", peer.agent_name.encode(), peer.layout)
    active([{"point": "done_hold", "action": "delay", "p": 1.0, "s": 0.5}])
    x: Transfer = us.start("READ", peer, [0, 1], [2, 3])
    t0 = time.monotonic()
    while us.poll(x) == "PROC":
        time.sleep(0.01)
    assert x.state == "DONE" and time.monotonic() - t0 >= 0.5
    active([])
    us.notify(peer, b"again")
    assert _ask(conn, "notifs", 5.0) == [b"again"]
    _ask(conn, "notify", b"back")
    assert _notifs(us) == [b"back"]


def test_events_are_json_lines(active, tmp_path):
    active([{"point": "notify", "action": "drop", "p": 1.0}])
    faults.lost("notify")
    (line,) = events(tmp_path)
    assert set(line) == {"t", "tag", "point", "action", "s"}
    assert msgspec.json.decode(json.dumps(line).encode())["point"] == "notify"
