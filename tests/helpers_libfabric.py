"""What the LIBFABRIC transport tests share (tests/test_libfabric_{transfer,faults}.py):
kvferry's Transport over NIXL's LIBFABRIC backend in spawned agent processes, started
with tests/libfabric_host.env() (the plugin's libfabric and CUDA stubs resolve from
LD_LIBRARY_PATH at process start), driven over a pipe (Agent); KV planes of two kinds
("mixed", "big") with per-block digests computed from the tensors themselves (not from
kvferry's layout code); the descriptor count kvferry posts; one transfer (move).

A test module takes the agent-pair fixtures by naming them at module level
(``mixed = helpers_libfabric.mixed``)."""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
import time
from collections.abc import Iterator

import libfabric_host
import pytest
import torch

from kvferry.connectors.config import ConnectorConfig
from kvferry.connectors.memory.backends import CpuBackend, KVLayout
from kvferry.connectors.transfer.layout import runs

N, BS = 1024, 4  # "mixed": 1024 small blocks in dense, blocks-first and strided planes
NB, BIG = 64, 1 << 18  # "big": 64 blocks of 1 MiB per plane, K and V (128 MiB per agent)
CFG = ConnectorConfig()  # the timeouts kvferry's worker bounds transfers with


def make_caches(kind: str) -> dict[str, torch.Tensor]:
    if kind == "big":
        return {"big": torch.zeros(2, NB, BIG)}
    shared = torch.zeros(2 * N, 2, BS, 8)
    return {"dense": torch.zeros(2, N, BS, 2, 8), "blocks_first": torch.zeros(N, 2, BS, 2, 4),
            "strided": shared[::2], "shared_rest": shared[1::2]}


def block(t: torch.Tensor, name: str, b: int) -> torch.Tensor:
    return t[:, b] if name in ("dense", "big") else t[b]


def digests(caches: dict[str, torch.Tensor], ids: list[int]) -> list[bytes]:
    """One digest per block over every cache's bytes of that block."""
    out = []
    for b in ids:
        h = hashlib.blake2b(digest_size=16)
        for name, t in caches.items():
            h.update(block(t, name, b).contiguous().view(torch.uint8).numpy().tobytes())
        out.append(h.digest())
    return out


def _agent_main(conn, kind: str, name: str) -> None:  # a spawned agent process
    from kvferry.connectors.transfer.transport import Transport

    caches = make_caches(kind)
    lay = CpuBackend().describe(caches, NB if kind == "big" else N, BS)
    tr = Transport(lay, backends=("LIBFABRIC",), name=name,  # as the connector's worker does
                   add_peer_timeout_s=CFG.handshake_timeout_s)
    peers, xfers = {}, {}

    def wait(xid: int, timeout: float) -> tuple[str, float]:
        t0 = time.monotonic()
        while (state := tr.poll(xfers[xid])) == "PROC" and time.monotonic() - t0 < timeout:
            time.sleep(0.001)
        return state, time.monotonic() - t0

    def notifs(timeout: float, expect: int) -> list[bytes]:
        deadline, got = time.monotonic() + timeout, []
        while len(got) < expect and time.monotonic() < deadline:
            got += tr.notifications()
            time.sleep(0.002)
        return got

    def fill(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for t in caches.values():
            t.view(torch.int32).copy_(torch.randint(-2**31, 2**31 - 1, t.shape, generator=g,
                                                    dtype=torch.int32))

    def start(op, key, local, remote, notif=b"", merge=True, lanes=1):
        x = tr.start(op, peers[key], local, remote, notif, merge=merge, lanes=lanes)
        xfers[id(x)] = x
        return id(x), x.ndesc, x.nbytes, len(x.handles)

    def notif_digests(timeout: float, ids: list[int]):
        """The bytes of ``ids`` at the moment the first notification is seen."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if got := tr.notifications():
                return got, digests(caches, ids)
            time.sleep(0.0005)
        return [], digests(caches, ids)

    def drop(key: str) -> float:
        t0 = time.monotonic()
        tr.drop_peer(key)
        return time.monotonic() - t0

    def release(xid: int) -> float:
        t0 = time.monotonic()
        tr.release(xfers.pop(xid))
        return time.monotonic() - t0

    def idle_cores(seconds: float) -> float:
        c0, w0 = time.process_time(), time.monotonic()
        time.sleep(seconds)
        return (time.process_time() - c0) / (time.monotonic() - w0)

    def add_peer(key: str, md: bytes, wire: dict) -> None:
        peers[key] = tr.add_peer(key, md, KVLayout.from_wire(wire))

    cmds = {
        "meta": lambda: (tr.metadata(), lay.to_wire(), list(tr.agent.backends)),
        "add_peer": add_peer,
        "fill": fill,
        "digests": lambda ids: digests(caches, ids),
        "start": start,
        "wait": wait,
        "poll": lambda xid: tr.poll(xfers[xid]),
        "raw_states": lambda xid: [tr.agent.check_xfer_state(h) for h in xfers[xid].handles],
        "notifs": notifs,
        "notif_digests": notif_digests,
        "notify": lambda key, msg: tr.notify(peers[key], msg),
        "release": release,
        "drop_peer": drop,
        "idle_cores": idle_cores,
        "pid": os.getpid,
    }
    try:
        while True:
            cmd, args = conn.recv()
            if cmd == "stop":
                break
            try:
                conn.send(("ok", cmds[cmd](*args)))
            except Exception as e:
                conn.send(("exc", f"{type(e).__name__}: {e}"))
    finally:
        tr.close()


class Agent:
    """A spawned process owning one LIBFABRIC Transport, driven over a pipe."""

    def __init__(self, kind: str, name: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_agent_main, args=(child, kind, name), daemon=True)
        with environ(libfabric_host.env()):  # the child's loader reads it at exec
            self.proc.start()
        self.name = name
        self.meta, self.wire, self.backends = self("meta", timeout=60)

    def call(self, cmd: str, *args, timeout: float = 30) -> tuple[str, object]:
        self.conn.send((cmd, args))
        if not self.conn.poll(timeout):
            raise AssertionError(f"{self.name} did not answer {cmd} within {timeout}s")
        return self.conn.recv()

    def __call__(self, cmd: str, *args, timeout: float = 30):
        status, value = self.call(cmd, *args, timeout=timeout)
        assert status == "ok", f"{self.name} {cmd}: {value}"
        return value

    def meet(self, other: Agent, key: str) -> None:
        self("add_peer", key, other.meta, other.wire)

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("stop", ()))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@contextlib.contextmanager
def environ(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def agents(*specs: tuple[str, str]) -> Iterator[list[Agent]]:
    started: list[Agent] = []
    try:
        for kind, name in specs:
            started.append(Agent(kind, name))
        yield started
    finally:
        for a in started:
            a.stop()


@pytest.fixture(scope="module")
def mixed() -> Iterator[tuple[Agent, Agent]]:
    """(P, D), each knowing the other as "P" / "D"."""
    with agents(("mixed", "lf-P"), ("mixed", "lf-D")) as (p, d):
        p.meet(d, "D")
        d.meet(p, "P")
        yield p, d


@pytest.fixture(scope="module")
def big() -> Iterator[tuple[Agent, Agent]]:
    with agents(("big", "lf-bigP"), ("big", "lf-bigD")) as (p, d):
        p.meet(d, "D")
        d.meet(p, "P")
        yield p, d


def expected_ndesc(lay: KVLayout, local: list[int], remote: list[int], merge: bool) -> int:
    """Descriptors kvferry posts: one per run of consecutive ids in dense planes (merged),
    else one per block."""
    nruns = len(runs(local, remote)) if merge else len(local)
    return sum(nruns if p.stride == p.block_bytes else len(local) for p in lay.planes)


def id_pairs(n: int, pattern: str) -> tuple[list[int], list[int]]:
    """(local, remote) ids of ``n`` blocks: "runs" maps a few long runs, "scattered" a
    random one-to-one map (almost every block its own descriptor)."""
    g = torch.Generator().manual_seed(n)
    if pattern == "runs":
        local = list(range(N - n, N)) if n < N else list(range(N))
        remote = list(range(n))
        if n > 3:  # break into three runs at different offsets on each side
            k = n // 3
            remote = remote[k:2 * k] + remote[:k] + remote[2 * k:]
        return local, remote
    local = torch.randperm(N, generator=g)[:n].tolist()
    remote = torch.randperm(N, generator=g)[:n].tolist()
    return local, remote


def move(p: Agent, d: Agent, op: str, local: list[int], remote: list[int], notif: bytes,
         merge: bool = True, lanes: int = 1) -> tuple[int, int]:
    """D moves blocks with P (READ: P -> D, WRITE: D -> P), checks every moved block's
    bytes and that nothing else changed at the destination; returns (ndesc, nbytes).

    A READ's bytes are D's once D sees DONE. A WRITE's are P's once P sees its
    notification, not when D sees DONE (which only frees D's source: under load P's
    bytes were seen incomplete then), so that is when they are compared, as kvferry's
    push path acts on that notification."""
    p("fill", 11)
    d("fill", 22)
    dst, src = (d, p) if op == "READ" else (p, d)
    dst_ids, src_ids = (local, remote) if op == "READ" else (remote, local)
    dst_all = dst("digests", list(range(N)))
    want = src("digests", src_ids)
    xid, ndesc, nbytes, _ = d("start", op, "P", local, remote, notif, merge, lanes)
    if op == "WRITE":
        got, at_notif = p("notif_digests", CFG.recv_timeout_s, dst_ids, timeout=CFG.recv_timeout_s + 30)
        assert got == [notif] and at_notif == want
    assert d("wait", xid, CFG.recv_timeout_s)[0] == "DONE"
    if op == "READ":
        assert dst("digests", dst_ids) == want
        assert p("notifs", 10, 1) == [notif]  # exactly this one: the next test would see a duplicate
    moved = set(dst_ids)
    now = dst("digests", list(range(N)))
    assert [now[b] for b in range(N) if b not in moved] == [dst_all[b] for b in range(N) if b not in moved]
    return ndesc, nbytes
