"""Transport (connectors/transfer/transport.py) over real NIXL/UCX between two processes, DRAM tensors.

The peer process plays P: it owns its KV tensors and a Transport, and answers commands over a
multiprocessing Pipe. The test process plays D with its own Transport and tensors.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from kvferry.connectors.memory.backends import CpuBackend, KVLayout
from kvferry.connectors.transfer.layout import LayoutMismatch, runs
from kvferry.connectors.transfer.transport import Transfer, TransferError, Transport

pytestmark = pytest.mark.timeout(120)

N = 12  # blocks per layer
BS = 4  # tokens per block


def make_caches(fill: float | None) -> dict[str, torch.Tensor]:
    """Three layer kinds: dense (2,N,..) planes, blocks-first (N,2,..), and a strided view
    (every other block of a bigger buffer, so its plane is not dense) sharing storage with
    another layer."""
    g = torch.Generator().manual_seed(1234)

    def t(*shape):
        return torch.randn(*shape, generator=g) if fill is None else torch.full(shape, fill)

    shared = t(2 * N, 2, BS, 8)
    return {
        "dense": t(2, N, BS, 2, 8),
        "blocks_first": t(N, 2, BS, 2, 4),
        "strided": shared[::2],         # (N, 2, BS, 8), stride 2 blocks
        "shared_rest": shared[1::2],   # same storage as "strided"
    }


def block(t: torch.Tensor, name: str, ids: list[int]) -> torch.Tensor:
    return t[:, ids] if name == "dense" else t[ids]


def _p_main(conn, env: dict[str, str]) -> None:  # runs in the spawned child
    os.environ.update(env)
    caches = make_caches(None)
    lay = CpuBackend().describe(caches, N, BS)
    tr = Transport(lay, name="kvferry-test-P")
    conn.send((tr.metadata(), lay.to_wire()))
    d_meta, d_wire = conn.recv()
    peer = tr.add_peer("D", d_meta, KVLayout.from_wire(d_wire))
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "stop":
                break
            if cmd == "notifs":
                deadline, got = time.monotonic() + args[0], []
                while not got and time.monotonic() < deadline:
                    got = tr.notifications()
                    time.sleep(0.005)
                conn.send(got)
            elif cmd == "dump":
                conn.send({k: v.clone() for k, v in caches.items()})
            elif cmd == "notify":
                tr.notify(peer, args[0])
                conn.send("ok")
    finally:
        tr.close()
        conn.close()


@pytest.fixture(scope="module")
def pair():
    """(D transport, D caches, P peer, pipe to P, P's original caches)."""
    env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_p_main, args=(child, env), daemon=True)
    proc.start()
    if not parent.poll(60):
        proc.kill()
        pytest.fail("P process did not start its NIXL agent")
    p_meta, p_wire = parent.recv()
    caches = make_caches(0.0)
    lay = CpuBackend().describe(caches, N, BS)
    tr = Transport(lay, name="kvferry-test-D")
    peer = tr.add_peer("P", p_meta, KVLayout.from_wire(p_wire))
    parent.send((tr.metadata(), lay.to_wire()))
    yield tr, caches, peer, parent, make_caches(None)
    parent.send(("stop",))
    proc.join(10)
    if proc.is_alive():
        proc.kill()
    tr.close()


def ask(conn, *cmd, timeout: float = 20):
    conn.send(cmd)
    assert conn.poll(timeout), f"P did not answer {cmd[0]}"
    return conn.recv()


def wait(tr: Transport, x: Transfer, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while (state := tr.poll(x)) == "PROC" and time.monotonic() < deadline:
        time.sleep(0.002)
    return state


def d_notifs(tr: Transport, timeout: float = 10) -> list[bytes]:
    deadline, got = time.monotonic() + timeout, []
    while not got and time.monotonic() < deadline:
        got = tr.notifications()
        time.sleep(0.005)
    return got


def expected_ndesc(tr: Transport, peer, local, remote) -> int:
    nruns = len(runs(local, remote))
    return sum(nruns if lp.stride == lp.block_bytes and rp.stride == rp.block_bytes else len(local)
               for lp, rp in zip(tr.layout.planes, peer.layout.planes, strict=True))


LOCAL = [0, 1, 2, 5, 9, 10]
REMOTE = [3, 4, 5, 0, 7, 8]  # runs: (0,3,3) (5,0,1) (9,7,2)


def test_layout_under_test_has_dense_and_non_dense_planes(pair):
    tr, *_ = pair
    dense = [p.stride == p.block_bytes for p in tr.layout.planes]
    assert any(dense) and not all(dense)
    assert len(tr.layout.regions) == 3  # "strided" and "shared_rest" share one storage


def test_read_copies_exactly_the_requested_blocks_and_notifies_p(pair):
    tr, d, peer, conn, _ = pair
    for t in d.values():
        t.zero_()
    p_orig = ask(conn, "dump")
    x = tr.start("READ", peer, LOCAL, REMOTE, b"kvferry/done/req-read")
    assert x.ndesc == expected_ndesc(tr, peer, LOCAL, REMOTE)
    per_block = len(tr.layout.planes) * len(LOCAL)
    assert x.ndesc < per_block  # merged runs: fewer descriptors than one per block per plane
    assert x.nbytes == len(LOCAL) * sum(p.block_bytes for p in tr.layout.planes)
    assert wait(tr, x) == "DONE" and x.handles == []  # handle released on completion
    assert tr.poll(x) == "DONE"
    untouched = [b for b in range(N) if b not in LOCAL]
    for name, t in d.items():
        assert torch.equal(block(t, name, LOCAL), block(p_orig[name], name, REMOTE)), name
        assert not block(t, name, untouched).any(), name
    assert ask(conn, "notifs", 10) == [b"kvferry/done/req-read"]
    # the read left P's memory as it was
    p_now = ask(conn, "dump")
    assert all(torch.equal(p_now[k], p_orig[k]) for k in p_orig)


def test_write_puts_exactly_the_requested_blocks_and_notifies_p(pair):
    tr, d, peer, conn, _ = pair
    p_orig = ask(conn, "dump")
    for t in d.values():
        t.copy_(torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape) + 0.5)
    local, remote = [11, 3, 4, 6], [1, 9, 10, 2]
    x = tr.start("WRITE", peer, local, remote, b"kvferry/done/req-write")
    assert x.ndesc == expected_ndesc(tr, peer, local, remote)
    assert wait(tr, x) == "DONE"
    assert ask(conn, "notifs", 10) == [b"kvferry/done/req-write"]
    p_now = ask(conn, "dump")
    untouched = [b for b in range(N) if b not in remote]
    for name in p_orig:
        assert torch.equal(block(p_now[name], name, remote), block(d[name], name, local)), name
        # the strided plane's neighbours ("shared_rest" blocks in between) stay intact
        assert torch.equal(block(p_now[name], name, untouched), block(p_orig[name], name, untouched))


def test_fully_contiguous_read_is_one_descriptor_per_dense_plane(pair):
    tr, d, peer, conn, _ = pair
    p_now = ask(conn, "dump")
    x = tr.start("READ", peer, list(range(4)), list(range(6, 10)))
    dense = sum(p.stride == p.block_bytes for p in tr.layout.planes)
    assert x.ndesc == dense + 4 * (len(tr.layout.planes) - dense)
    assert wait(tr, x) == "DONE"
    for name, t in d.items():
        assert torch.equal(block(t, name, [0, 1, 2, 3]), block(p_now[name], name, [6, 7, 8, 9])), name


def test_empty_transfer_still_delivers_notification(pair):
    tr, d, peer, conn, _ = pair
    x = tr.start("READ", peer, [], [], b"kvferry/done/release")
    assert (x.state, x.ndesc, x.nbytes, x.handles) == ("DONE", 0, 0, [])
    assert tr.poll(x) == "DONE"
    assert ask(conn, "notifs", 10) == [b"kvferry/done/release"]


def test_notifications_flow_both_ways(pair):
    tr, d, peer, conn, _ = pair
    tr.notify(peer, b"d->p")
    assert ask(conn, "notifs", 10) == [b"d->p"]
    assert ask(conn, "notify", b"p->d") == "ok"
    assert d_notifs(tr) == [b"p->d"]
    assert tr.notifications() == []  # consumed


def test_out_of_range_ids_raise_before_posting(pair):
    tr, _, peer, conn, _ = pair
    with pytest.raises(IndexError, match="remote block id 12"):
        tr.start("READ", peer, [0], [N])
    with pytest.raises(IndexError, match="local block id"):
        tr.start("READ", peer, [N + 5], [0], b"never")
    assert ask(conn, "notifs", 0.3) == []  # no notification for a refused transfer


def test_mismatched_layout_refused_by_add_peer(pair):
    tr, _, peer, _, _ = pair
    other = CpuBackend().describe({"x": torch.zeros(2, N, BS, 3)}, N, BS)
    with pytest.raises(LayoutMismatch):
        tr.add_peer("other", b"unused", other)
    assert tr.peer("other") is None and tr.peer("P") is peer


def test_missing_nixl_backend_is_transfer_error():
    with pytest.raises(TransferError, match="NOPE"):
        Transport(KVLayout((), (), 4, 4), backends=("NOPE",))


def test_drop_peer_forgets_it_and_posting_fails(pair):
    # uses its own agent so the shared fixture keeps working
    tr, _, peer, _, _ = pair
    lay = tr.layout
    t2 = Transport(CpuBackend().describe(make_caches(0.0), N, BS))
    try:
        assert lay.signature() == t2.layout.signature()
        p2 = t2.add_peer("P", tr.metadata(), lay)
        assert t2.peer("P") is p2
        t2.drop_peer("P")
        assert t2.peer("P") is None
        t2.drop_peer("P")  # idempotent
        with pytest.raises(TransferError):
            t2.start("READ", p2, [0], [0])
    finally:
        t2.close()


def test_idle_agents_do_not_spin(pair):
    """A connected, idle agent leaves the CPU alone (nixl's own default progress thread
    busy-polls a core per agent, which starves co-located engines)."""
    tr, _, peer, conn, _ = pair
    x = tr.start("READ", peer, [0, 1], [2, 3])
    assert wait(tr, x) == "DONE"
    time.sleep(0.3)
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(2.0)
    used = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    assert used < 0.25, f"idle process used {used:.2f} cores"


def test_agents_turn_cuda_ipc_get_on_unless_the_environment_says(monkeypatch) -> None:
    """Same-GPU READs were emulated over TCP at ~400 MB/s with UCX's default (auto): every
    agent asks for cuda_ipc GET, and a user's own setting wins."""
    from kvferry.connectors.transfer import backend_settings, transport

    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", raising=False)
    assert backend_settings.ucx_defaults() == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "on"
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "off")
    assert backend_settings.ucx_defaults() == {}
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "off"
    agent = transport.make_agent("ucx-env-test", ["UCX"], 1000)  # a real agent starts with it
    assert "UCX" in agent.backends
    del agent


def test_adding_a_peer_is_bounded_by_the_handshake_only_where_it_waits_on_the_peer() -> None:
    """LIBFABRIC's add waits on the peer: the handshake bound. UCX's is local work: the
    transfer's own deadline, so a starved process is not turned into a recompute."""
    from kvferry.connectors.transfer.backend_settings import add_peer_bound

    assert add_peer_bound(["LIBFABRIC"], 5.0, 30.0) == 5.0
    assert add_peer_bound(["UCX", "LIBFABRIC"], 5.0, 30.0) == 5.0
    assert add_peer_bound(["UCX"], 5.0, 30.0) == 30.0


def test_add_peer_gives_up_after_its_timeout_and_the_call_stays_in_its_thread(pair) -> None:
    """LIBFABRIC's add_remote_agent blocks while the peer is unreachable: with
    add_peer_timeout_s the Transport raises instead of hanging its caller (the
    connector's transfer thread). A FAKE agent that blocks stands in for it here."""
    import threading

    tr, _, peer, _, _ = pair
    t2 = Transport(CpuBackend().describe(make_caches(0.0), N, BS), add_peer_timeout_s=0.5)
    release = threading.Event()

    class FakeBlockingAgent:
        def __init__(self, real) -> None:
            self.real = real

        def add_remote_agent(self, md: bytes) -> str:
            release.wait(30)
            return self.real.add_remote_agent(md)

        def __getattr__(self, name: str):
            return getattr(self.real, name)

    try:
        assert t2.add_peer("P", tr.metadata(), tr.layout).agent_name == tr.name  # in time: as before
        t2.drop_peer("P")
        t2.agent = FakeBlockingAgent(t2.agent)
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="within 0.5s"):
            t2.add_peer("P", tr.metadata(), tr.layout)
        assert 0.5 <= time.monotonic() - t0 < 2 and t2.peer("P") is None
    finally:
        release.set()
        t2.agent = getattr(t2.agent, "real", t2.agent)
        t2.close()
