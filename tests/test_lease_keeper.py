"""D's LeaseKeeper (connectors/scheduling/lease_keeper.py): grants over full blocks, signed offers,
renew/release/info, and time-based frees (grace after release, expiry, eviction)."""

from __future__ import annotations

import pytest
from helpers_clock import Clock

from kvferry.connectors.protocol.lease import LeaseError
from kvferry.connectors.protocol.params import SECRET_ENV, SIG, InvalidParams, parse_lease
from kvferry.connectors.protocol.prefix import block_hashes
from kvferry.connectors.scheduling.lease_keeper import TICK_S, LeaseKeeper

BS = 4
T0 = 1000.0
TTL = 100.0
GRACE = 3.0
TOKENS = list(range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens
BLOCKS = [7, 8, 9]


@pytest.fixture(autouse=True)
def _secret(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "test-secret")


def keeper(clock: Clock, **kw) -> LeaseKeeper:
    kw = {"ttl": TTL, "max_lifetime": 1000.0, "free_grace": GRACE, **kw}
    return LeaseKeeper("D0", "boot-1", "10.0.0.2", 5700, BS, 1, clock=clock, **kw)


def grant(k: LeaseKeeper, lid: str = "L1", blocks=BLOCKS, tokens=TOKENS, computed: int = 10,
          req: str | None = None, **extra) -> dict | None:
    return k.grant(req or f"req-{lid}", {"lease_id": lid, **extra}, blocks, tokens, computed)


def reason(fn) -> str:
    with pytest.raises(LeaseError) as e:
        fn()
    return e.value.reason


# -- grant -------------------------------------------------------------------------------------
@pytest.mark.parametrize("blocks,computed,n_blocks", [
    (BLOCKS, 10, 2),      # the partial third block is never leased
    (BLOCKS, 9, 2),       # the last token's KV not computed: still 2 full blocks
    (BLOCKS, 8, 2),
    (BLOCKS, 7, 1),       # KV of only 7 tokens: 1 full block
    (BLOCKS, 50, 2),      # num_computed beyond the tokens is clamped to them
    ([7], 10, 1),         # fewer blocks than the tokens need
    ([7, 8, 9, 10], 10, 2),
])
def test_grant_covers_only_full_blocks_of_computed_tokens(blocks, computed, n_blocks):
    c = Clock()
    k = keeper(c)
    signed = grant(k, blocks=blocks, computed=computed)
    assert signed is not None
    o = parse_lease(signed)  # verifies with KVFERRY_SECRET
    n_tok = n_blocks * BS
    assert o.block_ids == blocks[:n_blocks] and o.num_tokens == n_tok
    assert o.block_hashes == block_hashes(TOKENS[:n_tok], BS)
    assert (o.engine_id, o.instance, o.host, o.port, o.lease_id) == ("D0", "boot-1", "10.0.0.2",
                                                                      5700, "L1")
    assert o.block_size == BS and o.tp_size == 1 and o.expiry == T0 + TTL
    assert k.num_blocks == n_blocks
    assert k.table.get("L1").req_id == "req-L1"


@pytest.mark.parametrize("blocks,computed", [(BLOCKS, 3), (BLOCKS, 0), ([], 10)])
def test_grant_without_a_full_block_keeps_nothing(blocks, computed):
    k = keeper(Clock())
    assert grant(k, blocks=blocks, computed=computed) is None
    assert k.num_blocks == 0 and k.due_frees() == []


def test_offer_signed_with_the_deployment_secret_only(monkeypatch):
    k = keeper(Clock())
    signed = grant(k)
    assert parse_lease(signed, key=b"test-secret").lease_id == "L1"
    with pytest.raises(InvalidParams, match="signature"):
        parse_lease(signed, key=b"other-deployment")
    with pytest.raises(InvalidParams, match="signature"):
        parse_lease({**signed, "block_ids": [0, 1]})  # a client picking other blocks
    monkeypatch.setenv(SECRET_ENV, "k2")
    signed2 = grant(k, "L2")
    parse_lease(signed2, key=b"k2")
    assert signed2[SIG] != signed[SIG]


@pytest.mark.parametrize("request_", [
    None, "L1", ["L1"], {}, {"lease_id": 5}, {"lease_id": None}, {"ttl": 5},
    {"lease_id": ""}, {"lease_id": "x" * 129},
])
def test_malformed_lease_request_keeps_nothing(request_):
    k = keeper(Clock())
    assert k.grant("r1", request_, BLOCKS, TOKENS, 10) is None
    assert k.num_blocks == 0 and len(k.table) == 0 and k.due_frees() == []


def test_longest_allowed_lease_id():
    assert grant(keeper(Clock()), "x" * 128) is not None


def test_duplicate_lease_id_refused_even_after_it_ended():
    c = Clock()
    k = keeper(c)
    assert grant(k, "L1", req="r1") is not None
    assert grant(k, "L1", req="r2") is None
    assert k.table.get("L1").req_id == "r1" and k.num_blocks == 2
    k.release("L1")
    assert grant(k, "L1", req="r3") is None  # ids are never reused
    c.t += GRACE
    assert k.due_frees() == ["r1"]  # r2/r3 were never kept: the caller frees them


@pytest.mark.parametrize("ttl,expiry", [
    (10, T0 + 10), (10.5, T0 + 10.5),
    (1000, T0 + TTL),          # a request cannot lengthen the keeper's TTL
    (0, T0 + TTL), (-5, T0 + TTL), ("10", T0 + TTL), (None, T0 + TTL),
])
def test_requested_ttl_only_shortens(ttl, expiry):
    k = keeper(Clock())
    assert parse_lease(grant(k, ttl=ttl)).expiry == expiry


def test_lease_capped_by_max_lifetime():
    k = keeper(Clock(), max_lifetime=30.0)
    assert parse_lease(grant(k)).expiry == T0 + 30.0


# -- renew / info --------------------------------------------------------------------------------
def test_renew_extends_and_resigns():
    c = Clock()
    k = keeper(c)
    first = grant(k, ttl=10)
    c.t += 5
    renewed = k.renew("L1")
    o = parse_lease(renewed)
    assert o.expiry == T0 + 5 + TTL and renewed[SIG] != first[SIG]
    assert {f: v for f, v in renewed.items() if f not in ("expiry", SIG)} == \
        {f: v for f, v in first.items() if f not in ("expiry", SIG)}
    assert k.table.get("L1").expiry == o.expiry
    assert parse_lease(k.info("L1")).expiry == o.expiry  # info serves the renewed offer
    c.t += 1
    assert parse_lease(k.renew("L1", ttl=TTL * 10)).expiry == c.t + TTL  # capped at D's TTL
    assert parse_lease(k.renew("L1", ttl=1.0)).expiry == c.t + TTL  # never shortens


def test_renew_keeps_lease_past_its_first_term():
    c = Clock()
    k = keeper(c)
    grant(k)
    c.t = T0 + TTL - 1
    k.renew("L1")
    c.t = T0 + TTL + 1
    assert k.due_frees() == []
    assert parse_lease(k.info("L1")).lease_id == "L1"


def test_renew_after_end_raises_with_reason():
    c = Clock()
    k = keeper(c)
    assert reason(lambda: k.renew("nope")) == "unknown"
    grant(k, "a")
    grant(k, "b")
    k.release("a")
    assert reason(lambda: k.renew("a")) == "released"
    c.t = T0 + TTL
    assert reason(lambda: k.renew("b")) == "expired"


def test_info_on_unknown_expired_released():
    c = Clock()
    k = keeper(c)
    assert reason(lambda: k.info("nope")) == "unknown"
    grant(k, "a")
    grant(k, "b")
    assert parse_lease(k.info("a")).lease_id == "a"
    k.release("a")
    assert reason(lambda: k.info("a")) == "released"
    c.t = T0 + TTL
    assert reason(lambda: k.info("b")) == "expired"  # expired, not yet swept
    k.due_frees()  # the sweep frees it; its tombstone still says expired
    assert k.table.get("b") is None
    assert reason(lambda: k.info("b")) == "expired"
    c.t += GRACE
    k.due_frees()
    assert reason(lambda: k.info("a")) == "released"


# -- frees ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("p_checked", [False, True], ids=["no-read", "read-allowed"])
def test_release_frees_at_once_or_a_grace_after_the_last_held_answer(p_checked):
    """No P was told the lease held: no READ can run, the blocks go at once. One was: they
    wait out that READ, a grace after the answer."""
    c = Clock()
    k = keeper(c)
    grant(k, req="r1")
    c.t += 10
    held = c.t
    if p_checked:  # P may READ until held + its READ timeout
        assert parse_lease(k.info("L1", for_read=True)).lease_id == "L1"
    c.t += 1
    k.release("L1")
    assert k.num_blocks == 0  # no longer leased either way
    if p_checked:
        c.t = held + GRACE - 0.01
        assert k.due_frees() == []
        c.t = held + GRACE
    assert k.due_frees() == ["r1"]
    c.t += 10
    assert k.due_frees() == []  # reported once
    assert reason(lambda: k.release("L1")) == "released"


def test_the_routers_lookup_is_no_read_and_does_not_delay_the_free():
    c = Clock()
    k = keeper(c)
    grant(k, req="r1")
    assert parse_lease(k.info("L1")).lease_id == "L1"  # the router fetching the offer
    k.release("L1")
    assert k.due_frees() == ["r1"]


def test_release_long_after_the_held_answer_frees_at_once():
    c = Clock()
    k = keeper(c)
    grant(k, req="r1")
    k.info("L1", for_read=True)
    c.t += GRACE + 5  # that READ has long ended
    k.release("L1")
    assert k.due_frees() == ["r1"]


def test_expiry_frees_at_the_sweep_or_a_grace_after_the_last_held_answer():
    c = Clock()
    k = keeper(c)
    grant(k, req="r1")
    grant(k, "L2", req="r2")
    c.t = T0 + TTL - 1
    assert k.due_frees() == [] and k.table.get("L1") is not None
    k.info("L2", for_read=True)  # a READ of L2 may run until T0 + TTL - 1 + its timeout
    c.t = T0 + TTL  # the sweep at expiry ends both leases
    assert k.due_frees() == ["r1"] and k.table.get("L2") is None
    c.t = T0 + TTL - 1 + GRACE - 0.01
    assert k.due_frees() == []
    c.t = T0 + TTL - 1 + GRACE
    assert k.due_frees() == ["r2"]


def test_sweep_runs_at_most_every_tick():
    c = Clock()
    k = keeper(c, free_grace=0.0)
    grant(k, req="r1", ttl=1)
    assert k.due_frees() == []  # this call swept
    c.t = T0 + 1
    assert k.due_frees() == ["r1"]
    grant(k, "L2", req="r2", ttl=0.01)
    c.t += TICK_S / 2
    assert k.due_frees() == []  # expired, but less than a tick since the last sweep
    c.t += TICK_S
    assert k.due_frees() == ["r2"]


def test_max_blocks_evicts_least_recently_used_with_grace():
    c = Clock()
    k = keeper(c, max_blocks=4)
    grant(k, "a", req="ra")
    grant(k, "b", req="rb")
    c.t += 1
    k.renew("a")  # a is now the most recently used
    assert grant(k, "c", req="rc") is not None
    assert k.num_blocks == 4 and k.table.get("b") is None
    assert reason(lambda: k.info("b")) == "released"
    assert parse_lease(k.info("a")).lease_id == "a"
    assert k.due_frees() == ["rb"]  # nobody was told b held: freed at once
    held = c.t
    k.info("a", for_read=True)
    grant(k, "d", req="rd")  # the cap again: a is now the least recently used
    assert k.table.get("a") is None
    c.t = held + GRACE - 0.01
    assert k.due_frees() == []  # P may still be reading a
    c.t = held + GRACE
    assert k.due_frees() == ["ra"]


def test_lease_larger_than_max_blocks_is_refused():
    k = keeper(Clock(), max_blocks=1)
    assert grant(k) is None
    assert k.num_blocks == 0 and len(k.table) == 0
    assert grant(k, "small", blocks=[7], computed=4) is not None


def test_evict_for_pressure_one_lease_per_call():
    c = Clock()
    k = keeper(c)
    assert k.evict_for_pressure() is False
    grant(k, "a", req="ra")
    grant(k, "b", req="rb")
    assert k.evict_for_pressure() is True  # releases a (least recently used)
    assert reason(lambda: k.info("a")) == "released"
    assert k.evict_for_pressure() is True  # a's free is pending: nothing else released
    assert k.table.get("b") is not None
    c.t += GRACE
    assert k.due_frees() == ["ra"]
    assert k.evict_for_pressure() is True  # now b goes
    assert reason(lambda: k.info("b")) == "released"
    c.t += GRACE
    assert k.due_frees() == ["rb"]
    assert k.evict_for_pressure() is False
    assert k.num_blocks == 0


def test_evict_for_pressure_honours_recent_use():
    c = Clock()
    k = keeper(c)
    grant(k, "a", req="ra")
    grant(k, "b", req="rb")
    k.renew("a")
    assert k.evict_for_pressure() is True
    assert k.table.get("a") is not None and k.table.get("b") is None


@pytest.mark.parametrize("free,total,head,wm,released", [
    (10, 100, 0, 0.05, []),             # above the 5-block reserve: nothing
    (5, 100, 0, 0.05, []),              # exactly at it
    (4, 100, 0, 0.05, ["a"]),           # below: the least recent lease (2 blocks) suffices
    (2, 100, 0, 0.05, ["a", "b"]),      # needs 3: a's 2 are not enough, b goes too
    (0, 100, 0, 0.05, ["a", "b", "c"]),  # short of 5 even with all 6: all go
    (10, 100, 12, 0.0, ["a"]),          # the first waiting request needs 12
    (10, 100, 10, 0.0, []),             # ... or exactly what is free
    (0, 100, 0, 0.0, []),               # no reserve, nobody waiting: vLLM's question only
])
def test_relieve_releases_least_recent_leases_until_the_want_is_covered(free, total, head, wm,
                                                                         released):
    c = Clock()
    k = keeper(c)
    for lid in ("a", "b", "c"):  # 2 blocks each, a granted first
        grant(k, lid, req=f"r{lid}")
    assert k.relieve(free, total, head, wm) == released
    assert k.released_for_pressure == len(released)
    for lid in released:
        assert reason(lambda lid=lid: k.info(lid)) == "released"
    assert k.num_blocks == 2 * (3 - len(released))


def test_relieve_counts_blocks_already_due():
    """A released lease nobody was reading frees in the next step; a step in between
    must not release more for the same shortfall."""
    c = Clock()
    k = keeper(c)
    for lid in ("a", "b"):
        grant(k, lid, req=f"r{lid}")
    assert k.relieve(3, 100, 0, 0.05) == ["a"]  # wants 5: 3 free + a's 2
    assert k.relieve(3, 100, 0, 0.05) == []  # a's blocks not handed back yet, but due
    assert k.relieve(2, 100, 0, 0.05) == ["b"]  # the shortfall grew by one block
    assert sorted(k.due_frees()) == ["ra", "rb"]
    assert k.relieve(0, 100, 0, 0.05) == [] and k.num_blocks == 0


def test_relieve_does_not_wait_for_blocks_a_read_keeps():
    """Blocks kept a grace for a READ in flight come too late for a waiting request:
    the next least recent lease goes instead."""
    c = Clock()
    k = keeper(c)
    for lid in ("a", "b", "c"):
        grant(k, lid, req=f"r{lid}")
    k.info("a", for_read=True)
    k.release("a")  # the router replaced it, within the grace of P's READ
    assert k.relieve(0, 100, 2, 0.0) == ["b"]  # a's 2 blocks come in GRACE: b's now
    assert k.due_frees() == ["rb"]
    c.t += GRACE
    assert k.due_frees() == ["ra"] and k.table.get("c") is not None
