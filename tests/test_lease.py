"""D-side leases: expiry boundaries, renewals, release, capacity, and a stateful model check."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvferry.connectors.protocol.lease import DEFAULT_TTL, FreeBlocks, LeaseError, LeaseTable, Refusal


def grant(t: LeaseTable, lid: str, now: float = 0.0, blocks=(1, 2, 3)):
    return t.grant(lid, f"req-{lid}", blocks, 16 * len(blocks), ["h"] * len(blocks), now)


def reason_of(fn) -> str:
    with pytest.raises(LeaseError) as e:
        fn()
    return e.value.reason


def test_default_ttl_is_decoder_kv_blocks_ttl():
    t = LeaseTable()
    expiry, freed = grant(t, "a", 100.0)
    assert DEFAULT_TTL == 480.0 and expiry == 580.0 and freed == []
    v = t.get("a")
    assert v is not None and v.block_ids == (1, 2, 3) and v.prefix_hashes == ("h",) * 3
    assert "a" in t and len(t) == 1 and t.num_blocks == 3


def test_expiry_boundary_in_tick():
    t = LeaseTable(10.0)
    grant(t, "a", 0.0)
    assert t.tick(9.999) == []
    assert t.tick(10.0) == [FreeBlocks("a", "req-a", (1, 2, 3), "expired")]
    assert t.tick(11.0) == [] and t.num_blocks == 0
    assert reason_of(lambda: t.renew("a", 11.0)) == "expired"
    assert reason_of(lambda: t.release("a")) == "expired"


def test_renew_extends_never_shortens_and_caps_at_lifetime():
    t = LeaseTable(10.0, max_lifetime=25.0)
    grant(t, "a", 0.0)
    assert t.renew("a", 5.0) == 15.0
    assert t.renew("a", 6.0, ttl=1.0) == 15.0  # never shortens
    assert t.renew("a", 14.0) == 24.0
    assert t.renew("a", 20.0) == 25.0  # capped at granted_at + max_lifetime
    assert t.tick(24.9) == []
    assert len(t.tick(25.0)) == 1


def test_renew_after_expiry_is_an_error_even_before_tick():
    t = LeaseTable(10.0)
    grant(t, "a", 0.0)
    assert reason_of(lambda: t.renew("a", 10.0)) == "expired"
    assert len(t.release("a")) == 1  # expired but still held: release frees it


def test_ttl_longer_than_lifetime_capped_at_grant():
    t = LeaseTable(100.0, max_lifetime=30.0)
    assert grant(t, "a", 0.0)[0] == 30.0


def test_release_frees_once():
    t = LeaseTable()
    grant(t, "a")
    (f,) = t.release("a")
    assert f.reason == "released" and f.block_ids == (1, 2, 3)
    assert reason_of(lambda: t.release("a")) == "released"
    assert t.tick(10_000.0) == []


def test_unknown_lease_errors():
    t = LeaseTable()
    for fn in (lambda: t.release("x"), lambda: t.renew("x", 0.0)):
        assert reason_of(fn) == "unknown"
    assert "unknown" in str(LeaseError("x", Refusal.UNKNOWN))


def test_duplicate_and_reused_ids_rejected():
    t = LeaseTable()
    grant(t, "a")
    assert reason_of(lambda: grant(t, "a")) == "duplicate"
    t.release("a")
    assert reason_of(lambda: grant(t, "a")) == "duplicate"


def test_invalid_grant():
    t = LeaseTable()
    assert reason_of(lambda: t.grant("a", "r", [-1], 16, [], 0.0)) == "invalid"
    assert reason_of(lambda: t.grant("a", "r", [1], -1, [], 0.0)) == "invalid"
    assert len(t) == 0
    with pytest.raises(ValueError):
        LeaseTable(0.0)


def test_release_frees_at_once_and_is_final():
    t = LeaseTable()
    grant(t, "a")
    (f,) = t.release("a", 1.0)
    assert f.reason == "released" and "a" not in t and t.num_blocks == 0
    assert reason_of(lambda: t.release("a")) == "released"
    assert reason_of(lambda: t.renew("a", 2.0)) == "released"


def test_least_recent_follows_grants_and_renewals():
    t = LeaseTable()
    assert t.least_recent() is None
    grant(t, "a", 0.0)
    grant(t, "b", 1.0)
    assert t.least_recent() == "a"
    t.renew("a", 2.0)
    assert t.least_recent() == "b"


def test_capacity_evicts_lru():
    t = LeaseTable(max_blocks=6)
    grant(t, "a", 0.0, (1, 2))
    grant(t, "b", 1.0, (3, 4))
    grant(t, "c", 2.0, (5, 6))
    t.renew("a", 3.0)  # a is now most recent; b is the LRU
    _, freed = grant(t, "d", 4.0, (7, 8, 9))
    assert [(f.lease_id, f.reason) for f in freed] == [("b", "evicted"), ("c", "evicted")]
    assert t.num_blocks == 5 and "a" in t and "d" in t and "b" not in t


def test_capacity_evicts_what_it_must_and_refuses_what_never_fits():
    t = LeaseTable(max_blocks=4)
    grant(t, "a", 0.0, (1, 2))
    grant(t, "b", 1.0, (3, 4))
    _, freed = grant(t, "c", 3.0, (5,))
    assert [f.lease_id for f in freed] == ["a"]
    assert reason_of(lambda: grant(t, "e", 4.0, (1, 2, 3, 4, 5))) == "too_large"
    assert "b" in t and "c" in t and "e" not in t  # nothing evicted by the refused grant


def test_grant_sweeps_expired_first():
    t = LeaseTable(10.0, max_blocks=3)
    grant(t, "a", 0.0, (1, 2, 3))
    _, freed = grant(t, "b", 20.0, (4,))
    assert [(f.lease_id, f.reason) for f in freed] == [("a", "expired")]


def test_tombstones_expire():
    t = LeaseTable(tombstone_ttl=10.0)
    grant(t, "a", 0.0)
    t.release("a", 0.0)
    t.tick(9.0)
    assert reason_of(lambda: t.renew("a", 9.0)) == "released"
    t.tick(10.0)
    assert reason_of(lambda: t.renew("a", 10.0)) == "unknown"


# -- stateful model check ----------------------------------------------------------------

LIDS = [f"l{i}" for i in range(5)]


class LeaseMachine(RuleBasedStateMachine):
    """Invariants: each lease freed exactly once; renewals never shorten; capacity
    respected; every lease freed in the end."""

    def __init__(self) -> None:
        super().__init__()
        self.t = LeaseTable(10.0, max_lifetime=30.0, max_blocks=8)
        self.now = 0.0
        self.granted: set[str] = set()
        self.freed: dict[str, int] = {}
        self.expiry: dict[str, float] = {}

    def _apply(self, freed: list[FreeBlocks]) -> None:
        for f in freed:
            self.freed[f.lease_id] = self.freed.get(f.lease_id, 0) + 1

    @rule(lid=st.sampled_from(LIDS), n=st.integers(1, 4))
    def grant(self, lid: str, n: int) -> None:
        try:
            exp, freed = self.t.grant(lid, lid, range(n), 16 * n, [], self.now)
        except LeaseError as e:
            assert e.reason == "duplicate" and lid in self.granted
            return
        assert lid not in self.granted
        self.granted.add(lid)
        self.expiry[lid] = exp
        self._apply(freed)

    @rule(lid=st.sampled_from(LIDS))
    def renew(self, lid: str) -> None:
        try:
            exp = self.t.renew(lid, self.now)
        except LeaseError:
            return
        assert exp >= self.expiry[lid]
        self.expiry[lid] = exp

    @rule(lid=st.sampled_from(LIDS))
    def release(self, lid: str) -> None:
        with contextlib.suppress(LeaseError):
            self._apply(self.t.release(lid))

    @rule(dt=st.sampled_from([0.5, 1.0, 5.0, 11.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self._apply(self.t.tick(self.now))

    @invariant()
    def freed_at_most_once_and_capacity(self) -> None:
        assert all(n == 1 for n in self.freed.values())
        assert self.t.num_blocks <= 8

    def teardown(self) -> None:
        self.now += 1000.0
        self._apply(self.t.tick(self.now))
        assert self.freed == {lid: 1 for lid in self.granted}
        assert self.t.num_blocks == 0 and len(self.t) == 0


TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
