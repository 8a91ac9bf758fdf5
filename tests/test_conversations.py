"""Router conversations (router/conversations/front.py) against a real D-side LeaseKeeper served
over the lease-control channel (ZMQ on loopback), no engines."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from helpers_http import free_port, lease_reason

from kvferry.connectors.protocol.params import SECRET_ENV, parse_lease
from kvferry.connectors.scheduling.lease_keeper import LeaseKeeper
from kvferry.connectors.transfer.lease_control import ControlServer
from kvferry.router.conversations.front import Conversations, LeaseUnavailable, Turn
from kvferry.router.conversations.registry import ANONYMOUS
from kvferry.router.metrics import RouterMetrics
from kvferry.router.settings import RouterSettings

KEY = b"test-secret"
BS = 4
TTL = 100.0
D_URL = "http://d"
TOKENS = list(range(100, 120))
A = {"authorization": "Bearer key-A"}
B = {"authorization": "Bearer key-B"}


@pytest.fixture(autouse=True)
def _secret(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, KEY.decode())  # the ControlServer verifies with it



class D:
    """One decode engine's lease side: a keeper (real clock) and its control server."""

    def __init__(self) -> None:
        self.keeper = LeaseKeeper("D0", "boot-1", "127.0.0.1", 5800, BS, ttl=TTL, free_grace=0.0)
        self.port = free_port()
        self.server = ControlServer(self.keeper, "127.0.0.1", self.port)
        self._n = 0

    def finish_turn(self, turn: Turn, ttl: float | None = None) -> dict:
        """D finished the turn's request: the lease the router asked for, signed."""
        self._n += 1
        offer = self.keeper.grant(f"req-{self._n}", turn.lease_request(ttl)["lease"],
                                  [1, 2, 3, 4, 5], TOKENS, len(TOKENS))
        assert offer is not None
        return offer

    def reason(self, lease_id: str) -> str | None:
        return lease_reason(self.keeper, lease_id)


@pytest.fixture
def d():
    d = D()
    yield d
    d.server.close()


def conversations(port: int, **kw) -> Conversations:
    settings = RouterSettings(prefill_urls=["http://p"], decode_urls=[D_URL],
                              decode_control_addrs=[f"127.0.0.1:{port}"], **kw)
    return Conversations(settings, RouterMetrics(), KEY)


def run(fn: Callable[[Conversations], object], port: int, **kw) -> None:
    async def go() -> None:
        conv = conversations(port, **kw)
        try:
            await fn(conv)
        finally:
            await conv.close()

    asyncio.run(go())


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.01)


def body(cid: str = "c1") -> dict:
    return {"conversation_id": cid, "messages": []}


def gauge(conv: Conversations) -> float:
    return conv.metrics.registry.get_sample_value("kvferry_router_conversations")


# -- begin / commit ------------------------------------------------------------------------------
def test_begin_needs_a_conversation_id(d):
    async def go(conv: Conversations) -> None:
        assert await conv.begin({}, {}) is None
        assert await conv.begin({"messages": [], "user": "u1"}, A) is None
        t1 = await conv.begin(body(), {})
        assert t1 is not None and t1.tenant == ANONYMOUS and t1.conversation_id == "c1"
        assert t1.entry is None and t1.prefill_params() == {}
        t2 = await conv.begin({}, {**A, "X-Session-ID": "s9"})
        assert t2.conversation_id == "s9" and t2.tenant not in (ANONYMOUS, "key-A")
        assert t1.lease_id != t2.lease_id
        assert t2.lease_request(None) == {"lease": {"lease_id": t2.lease_id}}
        assert t2.lease_request(30.0) == {"lease": {"lease_id": t2.lease_id, "ttl": 30.0}}

    run(go, d.port)


def test_commit_offer_is_scoped_to_the_tenant(d):
    async def go(conv: Conversations) -> None:
        turn = await conv.begin(body(), A)
        offer = d.finish_turn(turn)
        assert conv.commit_offer(turn, D_URL, offer) is True
        assert gauge(conv) == 1
        nxt = await conv.begin(body(), A)
        e = nxt.entry
        assert e is not None and (e.decode_url, e.engine_id, e.lease_id) == (D_URL, "D0", turn.lease_id)
        assert e.num_tokens == 20 and e.expiry == parse_lease(offer).expiry
        assert nxt.prefill_params() == {"reuse": offer}
        parse_lease(nxt.prefill_params()["reuse"])  # P can verify what it is handed
        # Another API key (or none) never sees it, even with the same conversation id.
        assert (await conv.begin(body(), B)).entry is None
        assert (await conv.begin(body(), {})).entry is None
        assert (await conv.begin(body(), {"x-api-key": "key-A"})).entry is not None
        assert conv.lookup("c1", B)[1] is None and conv.lookup("c1", A)[1] == e
        assert (await conv.begin(body("c2"), A)).entry is None

    run(go, d.port)


def test_commit_offer_refuses_unusable_offers(d):
    async def go(conv: Conversations) -> None:
        turn = await conv.begin(body(), A)
        other = await conv.begin(body("c2"), A)
        good = d.finish_turn(turn)
        assert conv.commit_offer(turn, D_URL, None) is False
        assert conv.commit_offer(turn, D_URL, "lease") is False
        assert conv.commit_offer(turn, D_URL, {}) is False
        assert conv.commit_offer(turn, D_URL, {**good, "expiry": "soon"}) is False
        assert conv.commit_offer(other, D_URL, good) is False  # another turn's lease
        assert conv.registry.size == 0 and gauge(conv) == 0
        assert d.reason(turn.lease_id) is None  # refusing an offer does not end D's lease

    run(go, d.port)


def test_next_turn_releases_the_lease_it_replaces(d):
    async def go(conv: Conversations) -> None:
        t1 = await conv.begin(body(), A)
        assert conv.commit_offer(t1, D_URL, d.finish_turn(t1))
        t2 = await conv.begin(body(), A)
        assert t2.entry.lease_id == t1.lease_id
        # t2 failed (nothing committed): turn 1's lease stays recorded and held.
        assert (await conv.begin(body(), A)).entry.lease_id == t1.lease_id
        assert d.reason(t1.lease_id) is None
        t3 = await conv.begin(body(), A)
        assert conv.commit_offer(t3, D_URL, d.finish_turn(t3))
        await until(lambda: t1.lease_id not in d.keeper.table)
        assert d.reason(t1.lease_id) == "released"
        assert d.keeper.due_frees() == ["req-1"]  # free_grace 0
        assert d.reason(t3.lease_id) is None
        assert conv.lookup("c1", A)[1].lease_id == t3.lease_id
        assert gauge(conv) == 1

    run(go, d.port)


def test_commit_later_fetches_the_offer_from_d(d):
    async def go(conv: Conversations) -> None:
        t1 = await conv.begin(body(), A)
        offer = d.finish_turn(t1)
        conv.commit_later(t1, D_URL)  # a streamed turn: the offer never reached the router
        assert conv.pending_commits == 1
        t2 = await conv.begin(body(), A)  # waits for the pending commit
        assert t2.entry is not None and t2.entry.lease_id == t1.lease_id
        assert parse_lease(t2.prefill_params()["reuse"]) == parse_lease(offer)
        assert conv.pending_commits == 0
        # D kept nothing for this turn (unknown lease): nothing recorded, turn 1 stays.
        conv.commit_later(t2, D_URL)
        t3 = await conv.begin(body(), A)
        assert t3.entry.lease_id == t1.lease_id
        # A decode URL without a control address: nothing to ask.
        other = await conv.begin(body("c2"), A)
        d.finish_turn(other)
        conv.commit_later(other, "http://unknown-d")
        assert (await conv.begin(body("c2"), A)).entry is None

    run(go, d.port)


# -- heartbeat / end -----------------------------------------------------------------------------
def test_heartbeat_renews_on_d(d):
    async def go(conv: Conversations) -> None:
        t1 = await conv.begin(body(), A)
        conv.commit_offer(t1, D_URL, d.finish_turn(t1, ttl=30.0))
        before = conv.lookup("c1", A)[1]
        assert before.expiry == pytest.approx(time.time() + 30.0, abs=5)
        assert await conv.heartbeat("c1", B) is None  # another tenant renews nothing
        assert d.keeper.table.get(t1.lease_id).expiry == before.expiry
        after = await conv.heartbeat("c1", A)
        assert after is not None and after.expiry > before.expiry
        assert after.expiry == pytest.approx(time.time() + TTL, abs=5)
        assert d.keeper.table.get(t1.lease_id).expiry == after.expiry
        assert parse_lease(after.kv_transfer_params).expiry == after.expiry
        assert conv.lookup("c1", A)[1] == after
        longer = await conv.heartbeat("c1", A, ttl=300.0)
        assert longer.expiry >= after.expiry
        assert d.keeper.table.get(t1.lease_id).expiry == longer.expiry
        assert (await conv.begin(body(), A)).prefill_params()["reuse"]["expiry"] == longer.expiry
        assert await conv.heartbeat("nope", A) is None

    run(go, d.port)


def test_heartbeat_drops_conversation_d_no_longer_holds(d):
    async def go(conv: Conversations) -> None:
        t1 = await conv.begin(body(), A)
        conv.commit_offer(t1, D_URL, d.finish_turn(t1))
        d.keeper.release(t1.lease_id)  # e.g. D evicted it under memory pressure
        assert await conv.heartbeat("c1", A) is None
        assert conv.lookup("c1", A)[1] is None and gauge(conv) == 0

        t2 = await conv.begin(body("c2"), A)
        conv.commit_offer(t2, D_URL, d.finish_turn(t2))
        d.server.keeper = LeaseKeeper("D0", "boot-2", "127.0.0.1", 5800, BS)  # D restarted
        assert await conv.heartbeat("c2", A) is None
        assert conv.lookup("c2", A)[1] is None

    run(go, d.port)


def test_heartbeat_keeps_entry_when_d_is_unreachable(d):
    async def go(conv: Conversations) -> None:
        t1 = await conv.begin(body(), A)
        conv.commit_offer(t1, D_URL, d.finish_turn(t1))
        t0 = time.monotonic()
        with pytest.raises(LeaseUnavailable, match="unreachable"):
            await conv.heartbeat("c1", A)
        assert time.monotonic() - t0 < 2.0
        assert conv.lookup("c1", A)[1] is not None  # maybe a blip: the lease may still hold

    run(go, free_port(), connect_timeout_s=0.2)


def test_end_releases_on_d(d):
    async def go(conv: Conversations) -> None:
        t1 = await conv.begin(body(), A)
        conv.commit_offer(t1, D_URL, d.finish_turn(t1))
        assert await conv.end("c1", B) is False  # not B's conversation
        assert d.reason(t1.lease_id) is None
        assert await conv.end("c1", A) is True
        assert d.reason(t1.lease_id) == "released" and d.keeper.due_frees() == ["req-1"]
        assert conv.lookup("c1", A)[1] is None and gauge(conv) == 0
        assert await conv.end("c1", A) is False
        assert (await conv.begin(body(), A)).entry is None

    run(go, d.port)


def test_end_waits_for_the_last_streamed_turn(d):
    """A client that ends its conversation right after a streamed turn: the turn's commit
    (still fetching D's offer) must not land after the end and leave its lease held."""
    async def go(conv: Conversations) -> None:
        t1 = await conv.begin(body(), A)
        d.finish_turn(t1)
        conv.commit_later(t1, D_URL)  # in flight when the end arrives
        assert conv.pending_commits == 1
        assert await conv.end("c1", A) is True
        assert d.reason(t1.lease_id) == "released"
        assert conv.lookup("c1", A)[1] is None and conv.pending_commits == 0

    run(go, d.port)


def test_end_forgets_even_if_d_already_let_go(d):
    async def go(conv: Conversations) -> None:
        t1 = await conv.begin(body(), A)
        conv.commit_offer(t1, D_URL, d.finish_turn(t1))
        d.keeper.release(t1.lease_id)
        assert await conv.end("c1", A) is True
        assert conv.lookup("c1", A)[1] is None

    run(go, d.port)


@pytest.mark.timing  # D's answers must come within the 0.3 s that makes the silent case
# quick: a CI core busy with engines once took longer (503 where 200 was due)
def test_heartbeat_endpoint_answers_200_404_and_503(d):
    """Over HTTP: renewed (200), nothing to renew (404), D silent (503, entry kept)."""
    from fastapi.testclient import TestClient

    from kvferry.router.api.app import create_app

    settings = RouterSettings(prefill_urls=["http://p"], decode_urls=[D_URL],
                              decode_control_addrs=[f"127.0.0.1:{d.port}"], connect_timeout_s=0.3)
    with TestClient(create_app(settings, KEY)) as client:
        conv: Conversations = client.app.state.conversations
        turn = client.portal.call(conv.begin, body(), A)
        conv.commit_offer(turn, D_URL, d.finish_turn(turn))
        url = "/v1/kvferry/conversations/c1"
        assert client.post(url + "/heartbeat", headers=A).status_code == 200
        assert client.post(url + "/heartbeat", headers=B).status_code == 404
        d.server.close()  # D stops answering its lease channel
        r = client.post(url + "/heartbeat", headers=A)
        assert r.status_code == 503 and "unreachable" in r.json()["error"]["message"]
        assert client.get(url, headers=A).status_code == 200


def test_conversation_endpoints_show_no_engine_internals(d):
    """GET and heartbeat tell the tenant its cached tokens and expiry, nothing of where
    the KV lives: no D URL, engine id, lease id, block ids, side-channel address."""
    from fastapi.testclient import TestClient

    from kvferry.router.api.app import CLIENT_FIELDS, create_app

    settings = RouterSettings(prefill_urls=["http://p"], decode_urls=[D_URL],
                              decode_control_addrs=[f"127.0.0.1:{d.port}"])
    with TestClient(create_app(settings, KEY)) as client:
        conv: Conversations = client.app.state.conversations
        turn = client.portal.call(conv.begin, body(), A)
        offer = d.finish_turn(turn)
        conv.commit_offer(turn, D_URL, offer)
        url = "/v1/kvferry/conversations/c1"
        got = client.get(url, headers=A)
        renewed = client.post(url + "/heartbeat", headers=A)
        assert got.status_code == 200 and renewed.status_code == 200
        for r in (got, renewed):
            assert tuple(r.json()) == CLIENT_FIELDS
            assert r.json()["conversation_id"] == "c1" and r.json()["cached_tokens"] == 20
            internals = [D_URL, "D0", "boot-1", turn.lease_id, "127.0.0.1", "5800", "block",
                         "sig", "lease", "engine", "decode", "kv_transfer_params"]
            assert not [s for s in internals if s in r.text], r.text
        assert got.json()["expires_at"] == parse_lease(offer).expiry
        assert renewed.json()["expires_at"] >= got.json()["expires_at"]
