"""router/conversations/continuation.py: conversations keyed by content, against a real D-side
LeaseKeeper behind the real lease-control channel, in memory and in a real redis-server:
forks, retirement of the continued entry, tenants, bounds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from fleet_stack import RedisServer
from helpers_http import free_port

from kvferry.connectors.protocol.lease import LeaseError
from kvferry.connectors.protocol.params import SECRET_ENV
from kvferry.connectors.scheduling.lease_keeper import LeaseKeeper
from kvferry.connectors.transfer.lease_control import ControlServer
from kvferry.router.conversations.front import Conversations, Turn
from kvferry.router.conversations.history import Answer, content_key, record
from kvferry.router.fleet.upstreams import Upstream
from kvferry.router.legs.turns import TurnCommit
from kvferry.router.metrics import RouterMetrics
from kvferry.router.settings import RouterSettings

KEY = b"continuation-secret"
D_URL = "http://d"
SYS = {"role": "system", "content": "Be brief."}
U1 = {"role": "user", "content": "q" * 200}


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, KEY.decode())


class D:
    def __init__(self) -> None:
        self.keeper = LeaseKeeper("D0", "boot-1", "127.0.0.1", 5800, 4, ttl=100.0, free_grace=0.0)
        self.port = free_port()
        self.server = ControlServer(self.keeper, "127.0.0.1", self.port)
        self.n = 0

    def reason(self, lease_id: str) -> str | None:
        try:
            self.keeper.info(lease_id)
        except LeaseError as e:
            return e.reason
        return None


@pytest.fixture
def d() -> Iterator[D]:
    d = D()
    yield d
    d.server.close()


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    srv = RedisServer()
    srv.start()
    try:
        yield srv.url
    finally:
        srv.stop()


def chat(*msgs: dict) -> dict:
    return {"model": "m", "messages": list(msgs)}


def user(t: str) -> dict:
    return {"role": "user", "content": t}


def assistant(t: str) -> dict:
    return {"role": "assistant", "content": t}


async def answered(conv: Conversations, d: D, turn: Turn, text: str) -> None:
    """What the turn's commit (`legs.turns.TurnCommit`) does once D answered `text`."""
    assert turn.view is not None
    turn.history = record(turn.view, Answer(text))
    assert turn.history is not None
    if turn.content:
        turn.conversation_id = content_key(turn.history)
    d.n += 1
    offer = d.keeper.grant(f"req-{d.n}", turn.lease_request(None)["lease"], [1, 2, 3], list(range(12)), 12)
    assert conv.commit_offer(turn, D_URL, offer)
    await conv.settled(turn)


async def until(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.01)


def run(d: D, state: str, fn, **kw) -> None:
    async def go() -> None:
        settings = RouterSettings(prefill_urls=["http://p"], decode_urls=[D_URL], state=state,
                                  decode_control_addrs=[f"127.0.0.1:{d.port}"], **kw)
        conv = Conversations(settings, RouterMetrics(), KEY)
        if state != "memory":
            await conv.state.redis.flushall()
        try:
            await fn(conv)
        finally:
            await conv.close()

    asyncio.run(go())


@pytest.fixture(params=["memory", "redis"])
def state(request: pytest.FixtureRequest) -> str:
    return "memory" if request.param == "memory" else request.getfixturevalue("redis_url")


def test_forks_keep_both_branches_and_each_continues_its_own(d: D, state: str):
    async def go(conv: Conversations) -> None:
        t1 = await conv.begin(chat(SYS, U1), {})
        assert t1 is not None and t1.content and t1.entry is None
        await answered(conv, d, t1, "a1")
        # Two follow-ups of turn 1 before either committed (a fork): both continue it.
        fa = await conv.begin(chat(SYS, U1, assistant("a1"), user("x")), {})
        fb = await conv.begin(chat(SYS, U1, assistant("a1"), user("y")), {})
        assert fa.entry is not None and fb.entry is not None
        assert fa.entry.lease_id == fb.entry.lease_id == t1.lease_id
        await answered(conv, d, fa, "ax")
        await until(lambda: d.reason(t1.lease_id) == "released")  # retired by the first
        await answered(conv, d, fb, "ay")
        assert d.reason(fa.lease_id) is None and d.reason(fb.lease_id) is None
        # Each branch's next turn finds its own entry, never the other's.
        ca = await conv.begin(chat(SYS, U1, assistant("a1"), user("x"), assistant("ax"),
                                   user("more")), {})
        cb = await conv.begin(chat(SYS, U1, assistant("a1"), user("y"), assistant("ay"),
                                   user("more")), {})
        assert ca.entry.lease_id == fa.lease_id and cb.entry.lease_id == fb.lease_id
        # A branch whose answer the client changed matches neither.
        cx = await conv.begin(chat(SYS, U1, assistant("a1"), user("x"), assistant("edited"),
                                   user("more")), {})
        assert cx.entry is None
        # A later fork of turn 1 finds nothing (its first continuation retired it): it
        # recomputes, which is safe.
        late = await conv.begin(chat(SYS, U1, assistant("a1"), user("z")), {})
        assert late.entry is None and late.continues is None

    run(d, state, go)


def test_tenants_never_share_content_entries(d: D, state: str):
    async def go(conv: Conversations) -> None:
        alice = {"authorization": "Bearer alice"}
        t = await conv.begin(chat(SYS, U1), alice)
        await answered(conv, d, t, "a1")
        nxt = chat(SYS, U1, assistant("a1"), user("x"))
        assert (await conv.begin(nxt, {"authorization": "Bearer bob"})).entry is None
        assert (await conv.begin(nxt, {})).entry is None
        assert (await conv.begin(nxt, alice)).entry.lease_id == t.lease_id

    run(d, state, go)


def test_an_explicit_id_wins_and_content_turns_are_bounded(d: D):
    async def go(conv: Conversations) -> None:
        t = await conv.begin(chat(SYS, U1), {})
        await answered(conv, d, t, "a1")
        nxt = chat(SYS, U1, assistant("a1"), user("x"))
        with_id = await conv.begin({**nxt, "conversation_id": "c9"}, {})
        assert with_id.conversation_id == "c9" and with_id.entry is None and not with_id.content
        # The LRU cap holds content entries like any other (max_conversations=2).
        for i in range(3):
            other = await conv.begin(chat(SYS, user(f"other {i}")), {})
            await answered(conv, d, other, f"o{i}")
        assert conv.registry.size == 2
        await until(lambda: d.reason(t.lease_id) == "released")  # evicted: lease released
        assert (await conv.begin(nxt, {})).entry is None

    run(d, "memory", go, max_conversations=2)


def test_an_unrecordable_answer_releases_the_lease_on_the_d_that_finished(d: D):
    """A content turn whose stream migrated to another D, and whose answer cannot be
    recorded (an error event): the lease is released on the D that finished the turn,
    where the migration asked for it, not on the first D."""
    d1 = D()
    try:
        async def go() -> None:
            settings = RouterSettings(prefill_urls=["http://p"], decode_urls=[D_URL, "http://d1"],
                                      decode_control_addrs=[f"127.0.0.1:{d.port}",
                                                            f"127.0.0.1:{d1.port}"])
            conv = Conversations(settings, RouterMetrics(), KEY)
            try:
                turn = await conv.begin(chat(SYS, U1), {})
                assert turn is not None and turn.content
                commit = TurnCommit(conv, turn, D_URL)
                # The migration gives the turn a fresh lease, granted by the new D.
                turn.lease_id = "lease-on-d1"
                d1.keeper.grant("req-1", turn.lease_request(None)["lease"], [1, 2, 3],
                                list(range(12)), 12)
                commit.moved(Upstream("http://d1"))
                assert commit.at == "http://d1"  # the commit follows the stream to d1
                assert commit.chunk_filter is not None
                commit.chunk_filter.feed(b'data: {"error": {"message": "boom"}}\n\n'
                                         b"data: [DONE]\n\n")
                await until(lambda: d1.reason("lease-on-d1") == "released")
                assert conv.metrics.registry.get_sample_value(
                    "kvferry_router_content_matches_total", {"result": "unrecorded"}) == 1
            finally:
                await conv.close()

        asyncio.run(go())
    finally:
        d1.server.close()
