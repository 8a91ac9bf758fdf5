"""The SQLite conversation store the router's worker processes share when no Redis is given
(router/conversations/sqlite_state.py): atomic replacement across processes, expiry, the
bound, a held lock, and two routers sharing a conversation through one file (fake engines,
a real D-side LeaseKeeper: tests/helpers_router_fleet.py)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path

import helpers_router_fleet
import pytest
from fleet_stack import wait_for
from helpers_fleet import P_PARAMS, LeasingD, metric_sum, reuse_of
from helpers_http import FakeEngine, serve
from helpers_router_fleet import router, turn

from kvferry.router.api import workers
from kvferry.router.conversations import lease_control, sqlite_state
from kvferry.router.conversations.registry import ConversationEntry
from kvferry.router.conversations.sqlite_state import SqliteState
from kvferry.router.metrics import RouterMetrics
from kvferry.router.settings import RouterSettings

_secret = helpers_router_fleet._secret
stack = helpers_router_fleet.stack
pd = helpers_router_fleet.pd


def _entry(lease: str, expiry: float) -> ConversationEntry:
    offer = {"engine_id": "d0-engine", "lease_id": lease, "block_ids": [1, 2], "expiry": expiry}
    return ConversationEntry("http://d0:8200", "d0-engine", lease, expiry, 32, offer)


def _state(path: Path, **kw: float) -> SqliteState:
    return SqliteState(str(path), RouterMetrics(), **kw)  # type: ignore[arg-type]


def _replacer(path: str, name: str, n: int, out: mp.Queue) -> None:
    """A worker process: `n` turns of one conversation, each a new lease; what it was given
    back to release."""
    state = SqliteState(path, RouterMetrics(), timeout_s=5.0)
    released: list[str] = []
    failed = 0

    async def go() -> None:
        nonlocal failed
        for i in range(n):
            got = await state.replace("t", "c1", _entry(f"{name}-{i}", time.time() + 60))
            if got is None:
                failed += 1
            else:
                released.extend(e.lease_id for e in got)

    asyncio.run(go())
    out.put((released, failed))


def test_processes_replacing_one_conversation_release_every_displaced_lease_once(
        tmp_path: Path) -> None:
    """Two processes write 300 turns each to one conversation at once: every lease but the
    one left in the store comes back to exactly one of them (so D gets each released once)."""
    path = str(tmp_path / "c.db")
    sqlite_state.connect(path, 1.0).close()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_replacer, args=(path, name, 300, out)) for name in "ab"]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    released = [lease for got, _ in results for lease in got]
    assert all(failed == 0 for _, failed in results)
    left = asyncio.run(_state(tmp_path / "c.db").get("t", "c1", time.time()))
    assert left is not None
    assert len(released) == len(set(released)) == 599
    assert set(released) | {left.lease_id} == {f"{n}-{i}" for n in "ab" for i in range(300)}


def test_expiry_drop_and_a_turn_already_expired(tmp_path: Path) -> None:
    async def go() -> None:
        a, b = _state(tmp_path / "s.db"), _state(tmp_path / "s.db")  # two workers' handles
        now = time.time()
        assert await a.replace("t", "c1", _entry("l1", now + 60)) == []
        assert (await b.get("t", "c1", now)).lease_id == "l1"
        assert await b.get("other-tenant", "c1", now) is None
        assert await b.get("t", "c1", now + 61) is None  # past the lease: no entry
        assert await b.size() == 1
        dropped = await b.drop("t", "c1")
        assert dropped is not None and dropped.lease_id == "l1"
        assert await a.drop("t", "c1") is None  # dropped once
        await a.replace("t", "c2", _entry("l2", now + 60))
        # A turn whose lease already ended: nothing stored, both leases handed back.
        back = await b.replace("t", "c2", _entry("l3", now - 1))
        assert sorted(e.lease_id for e in back) == ["l2", "l3"]
        assert await a.get("t", "c2", now) is None and await a.size() == 0
        await a.close()
        await b.close()

    asyncio.run(go())


def test_bounded_the_nearest_expiry_let_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sqlite_state, "SWEEP_EVERY_S", 0.0)

    async def go() -> None:
        s = _state(tmp_path / "b.db", max_entries=10)  # type: ignore[arg-type]
        now = time.time()
        let_go: list[str] = []
        for i in range(50):  # expiry rises with i except for c7, which expires last
            expiry = now + 1000 if i == 7 else now + 100 + i
            let_go += [e.lease_id for e in await s.replace("t", f"c{i}", _entry(f"l{i}", expiry))]
        assert len(let_go) == 40 and await s.size() == 10
        kept = {f"l{i}" for i in (7, *range(41, 50))}
        assert set(let_go) == {f"l{i}" for i in range(50)} - kept
        await s.close()

    asyncio.run(go())


def test_a_held_lock_costs_one_bounded_wait_and_reads_go_on(tmp_path: Path) -> None:
    """Another process holding the write lock: a replace gives up after its timeout (no
    entry recorded, counted as a state error); reads are not blocked (WAL)."""
    path = tmp_path / "l.db"

    async def go() -> None:
        s = _state(path, timeout_s=0.05)
        await s.replace("t", "c1", _entry("l1", time.time() + 60))
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        t0 = time.monotonic()
        assert await s.replace("t", "c1", _entry("l2", time.time() + 60)) is None
        assert time.monotonic() - t0 < 1.0
        assert (await s.get("t", "c1", time.time())).lease_id == "l1"
        errors = s.metrics.state_errors.labels(op="replace", kind="timeout")._value.get()
        assert errors == 1
        holder.execute("ROLLBACK")
        assert [e.lease_id for e in await s.replace("t", "c1", _entry("l2", time.time() + 60))
                ] == ["l1"]
        await s.close()

    asyncio.run(go())


def test_workers_without_redis_get_a_shared_file(tmp_path: Path) -> None:
    settings = RouterSettings(prefill_urls=["http://p"], decode_urls=["http://d"])
    assert workers.check(settings, 2) is None
    shared, folder = workers.shared_state(settings)
    try:
        assert folder is not None and shared.state.startswith("sqlite:///")
        path = sqlite_state.path_of(shared.state)
        assert Path(path).parent == folder and Path(path).exists()
        assert folder.parent == workers.state_dir()
        assert workers.state_dir() == (workers.SHM if shutil.disk_usage(workers.SHM).free
                                       >= workers.SHM_MIN_FREE else Path(tempfile.gettempdir()))
        redis = settings.model_copy(update={"state": "redis://127.0.0.1:1/0"})
        assert workers.shared_state(redis) == (redis, None)
    finally:
        if folder is not None:
            shutil.rmtree(folder)
    with pytest.raises(ValueError, match="absolute"):
        RouterSettings(prefill_urls=["http://p"], decode_urls=["http://d"],
                       state="sqlite://relative.db")


def test_two_routers_share_a_conversation_through_one_file(pd, stack, tmp_path: Path) -> None:
    """As two worker processes do: turn 2 on the other router is offered turn 1's KV on D,
    and the lease it replaced is released on D."""
    p, d, purl, durl = pd
    kw = {"prefill_urls": [purl], "decode_urls": [durl],
          "state": f"sqlite://{tmp_path / 'conv.db'}",
          "decode_control_addrs": [f"127.0.0.1:{d.control_port}"]}
    (a, app_a), (b, app_b) = router(stack, **kw), router(stack, **kw)
    assert turn(a).status_code == 200
    assert reuse_of(p) is None
    db = sqlite3.connect(tmp_path / "conv.db")
    [(lease1,)] = db.execute("SELECT json_extract(entry, '$.lease_id') FROM conversations")
    assert d.reason(lease1) is None
    assert turn(b).status_code == 200
    offer = reuse_of(p)
    assert offer is not None and offer["lease_id"] == lease1
    wait_for(lambda: d.reason(lease1) == "released", what="turn 1's lease released")
    assert turn(a).status_code == 200
    [(lease2,)] = db.execute("SELECT json_extract(entry, '$.lease_id') FROM conversations")
    assert lease2 != lease1 and reuse_of(p)["lease_id"] != lease1
    assert metric_sum(app_a, "kvferry_router_state_errors_total") == 0
    assert metric_sum(app_b, "kvferry_router_state_errors_total") == 0


class StreamingD(LeasingD):
    """A D that grants the turn's lease but, like vLLM before 0.33, does not stream its
    kv_transfer_params: the router fetches the offer over the lease-control channel."""

    def _answer(self, body: dict, chat: bool) -> tuple[str, list[bytes]]:
        text, _ = super()._answer(body, chat)
        event = {"id": "d-1", "object": "text_completion", "model": "tiny",
                 "choices": [{"index": 0, "text": "answer", "finish_reason": "stop"}]}
        return text, [f"data: {json.dumps(event)}\n\n".encode(), b"data: [DONE]\n\n"]


def test_streamed_turns_alternating_routers_each_find_the_last(
        stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Streamed turns of one conversation, each sent the moment the previous [DONE]
    arrived, to the other router (as SO_REUSEPORT may spread them over workers): each is
    offered the turn before's lease, because a router sends [DONE] only once the turn is
    stored. D's control channel answers 100 ms late, which the commit waits for. Before
    the fix, [DONE] went out first: the next turn read the entry before, whose lease its
    commit then released (in a real stack: `read_failed`, recompute)."""
    p, d = FakeEngine("p0", kv_params=dict(P_PARAMS)), StreamingD()
    stack.callback(d.server.close)
    purl, durl = (stack.enter_context(serve(e.app())) for e in (p, d.engine))

    async def late() -> bool:
        await asyncio.sleep(0.1)
        return False  # the call goes through

    monkeypatch.setattr(lease_control, "fault_hook", late)
    kw = {"prefill_urls": [purl], "decode_urls": [durl],
          "state": f"sqlite://{tmp_path / 'conv.db'}", "d_local_max_new_tokens": 0,
          "decode_control_addrs": [f"127.0.0.1:{d.control_port}"]}
    (a, _), (b, _) = router(stack, **kw), router(stack, **kw)
    db = sqlite3.connect(tmp_path / "conv.db")
    before = None
    for url in (a, b, a, b):
        r = turn(url, stream=True)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        rows = db.execute("SELECT json_extract(entry, '$.lease_id') FROM conversations").fetchall()
        assert len(rows) == 1, "the turn was not stored before the client had [DONE]"
        offer = reuse_of(p)
        assert (offer or {}).get("lease_id") == before
        assert rows[0][0] != before
        before = rows[0][0]


def test_entry_bytes_are_the_json_an_older_router_wrote_and_reads() -> None:
    """msgspec's encoding of an entry is byte for byte the json module's compact one, so
    routers of either version share a store; unreadable bytes read as no entry."""
    from kvferry.router.conversations.entry_codec import decode_entry, encode_entry

    offer = {"engine_id": "d0-engine", "lease_id": "l1", "block_ids": list(range(1500)),
             "block_hashes": [f"{i:016x}" for i in range(1500)], "expiry": 1.7e9 + 0.123456789,
             "sig": "f" * 64, "nested": {"a": [1, 2.5, None, True]}}
    entry = ConversationEntry("http://d0:8200", "d0-engine", "l1", offer["expiry"], 24000, offer,
                              prefix_hashes=("ab", "cd"), history={"kind": "chat", "n": [3]})
    raw = encode_entry(entry)
    assert raw == json.dumps(json.loads(raw), separators=(",", ":")).encode()
    assert decode_entry(raw) == entry
    assert decode_entry(raw.decode()) == entry
    for bad in (b"", b"{", b"[]", b'{"decode_url": 1}', b"\xff", "x"):
        assert decode_entry(bad) is None, bad
