"""The host tier's state machine (connectors/protocol/host_tier.py): scenarios, then random
operation sequences checked against its invariants after every step."""

from __future__ import annotations

import random

import pytest

from kvferry.connectors.protocol.host_tier import (
    HostTier,
    SlotsFreed,
    TierEnd,
    TierError,
    TierRefusal,
)
from kvferry.connectors.protocol.lease import Lease

TTL = 60.0


def lease(lid: str, blocks: int, now: float = 0.0, deadline: float = 3600.0) -> Lease:
    return Lease(lid, f"req-{lid}", tuple(range(100, 100 + blocks)), 16 * blocks,
                 (f"h-{lid}",), now, now + 10, deadline)


def ready(t: HostTier, lid: str, blocks: int, now: float = 0.0):
    spill, freed = t.spill(lease(lid, blocks, now), now)
    assert spill is not None
    entry, more = t.spilled(lid, now)
    assert entry is not None and entry.ready and not more
    return spill, freed


def test_a_spill_is_readable_only_once_its_copy_finished():
    t = HostTier(8, TTL)
    spill, freed = t.spill(lease("a", 3), 1.0)
    assert spill is not None and freed == []
    assert spill.block_ids == (100, 101, 102) and len(set(spill.slots)) == 3
    assert spill.req_id == "req-a" and t.num_free == 5
    with pytest.raises(TierError) as e:
        t.offer("a", 1.0, 5.0)
    assert e.value.reason is TierRefusal.NOT_READY
    entry, _ = t.spilled("a", 2.0)
    assert entry is not None and entry.slots == spill.slots and entry.expiry == 2.0 + TTL
    assert entry.num_tokens == 48 and entry.prefix_hashes == ("h-a",)
    assert t.offer("a", 3.0, 5.0).held_until == 8.0


def test_lru_eviction_makes_room_and_is_all_or_nothing():
    t = HostTier(6, TTL)
    ready(t, "a", 3, 0.0)
    ready(t, "b", 3, 1.0)
    t.renew("a", 2.0)  # a is now the most recent
    spill, freed = t.spill(lease("c", 2), 3.0)
    assert spill is not None
    assert [(f.lease_id, f.reason) for f in freed] == [("b", TierEnd.EVICTED)]
    assert "b" not in t and "a" in t and t.num_free == 1
    # 7 blocks never fit 6 slots: refused, nothing evicted
    spill, freed = t.spill(lease("d", 7), 4.0)
    assert spill is None and freed == [] and len(t) == 2


def test_entries_under_a_read_or_a_copy_are_never_evicted():
    t = HostTier(4, TTL)
    ready(t, "a", 2)
    t.offer("a", 0.0, 10.0)  # a READ may run until 10
    t.spill(lease("b", 2), 0.0)  # copying
    spill, freed = t.spill(lease("c", 1), 5.0)
    assert spill is None and freed == []  # the pool is full of held entries: recompute
    spill, freed = t.spill(lease("c", 1), 10.0)  # a's READ grace passed
    assert spill is not None and [f.lease_id for f in freed] == ["a"]


def test_release_during_a_read_keeps_the_slots_until_its_grace():
    t = HostTier(4, TTL)
    spill, _ = ready(t, "a", 2)
    t.offer("a", 1.0, 5.0)
    assert t.release("a", 2.0) == []  # ended, but the READ may still run
    assert "a" not in t and t.num_draining == 2 and t.num_free == 2
    with pytest.raises(TierError) as e:
        t.offer("a", 2.0, 1.0)
    assert e.value.reason is TierRefusal.UNKNOWN
    assert t.tick(5.9) == []
    assert t.tick(6.0) == [SlotsFreed("a", spill.slots, TierEnd.RELEASED)]
    assert t.num_free == 4 and t.num_draining == 0


def test_release_during_the_copy_ends_the_entry_when_the_copy_does():
    t = HostTier(4, TTL)
    spill, _ = t.spill(lease("a", 2), 0.0)
    assert t.release("a", 1.0) == []  # the copy still writes the slots
    assert t.num_free == 2
    with pytest.raises(TierError):
        t.renew("a", 1.0)
    entry, freed = t.spilled("a", 2.0)
    assert entry is None and freed == [SlotsFreed("a", spill.slots, TierEnd.RELEASED)]
    assert t.num_free == 4 and "a" not in t


def test_a_failed_copy_gives_the_slots_back_and_is_never_offered():
    t = HostTier(4, TTL)
    spill, _ = t.spill(lease("a", 3), 0.0)
    assert t.copy_failed("a", 1.0) == [SlotsFreed("a", spill.slots, TierEnd.COPY_FAILED)]
    assert t.num_free == 4
    with pytest.raises(TierError):
        t.spilled("a", 1.0)
    ready(t, "b", 1)
    with pytest.raises(TierError) as e:
        t.copy_failed("b", 1.0)  # its copy had finished
    assert e.value.reason is TierRefusal.DUPLICATE


def test_expiry_renewal_and_the_leases_deadline():
    t = HostTier(4, TTL)
    t.spill(lease("a", 1, deadline=100.0), 0.0)
    assert t.renew("a", 0.5) == 60.5  # renewed while copying
    entry, _ = t.spilled("a", 1.0)
    assert entry is not None and entry.expiry == 61.0
    assert t.renew("a", 50.0) == 100.0  # never past the HBM lease's deadline
    assert t.renew("a", 60.0, ttl=1.0) == 100.0  # never shortens
    freed = t.tick(100.0)
    assert [(f.lease_id, f.reason) for f in freed] == [("a", TierEnd.EXPIRED)]
    with pytest.raises(TierError):
        t.renew("a", 100.0)


def test_expired_but_not_yet_ticked_cannot_be_offered():
    t = HostTier(2, TTL)
    ready(t, "a", 1)
    with pytest.raises(TierError) as e:
        t.offer("a", TTL, 1.0)
    assert e.value.reason is TierRefusal.EXPIRED


def test_duplicate_spill_and_bad_construction_are_refused():
    t = HostTier(4, TTL)
    t.spill(lease("a", 1), 0.0)
    with pytest.raises(TierError) as e:
        t.spill(lease("a", 1), 0.0)
    assert e.value.reason is TierRefusal.DUPLICATE
    with pytest.raises(ValueError):
        HostTier(-1, TTL)
    with pytest.raises(ValueError):
        HostTier(4, 0.0)


def test_an_empty_pool_refuses_every_spill():
    t = HostTier(0, TTL)
    assert t.spill(lease("a", 1), 0.0) == (None, [])


@pytest.mark.parametrize("seed", range(200))
def test_random_operations_keep_every_slot_accounted_for(seed: int):
    """Every slot is free, owned by exactly one entry, or draining; each allocation comes
    back once; held or copying entries are never evicted; a refused spill changes
    nothing."""
    rng = random.Random(seed)
    n = rng.choice([1, 4, 9, 16])
    t = HostTier(n, rng.choice([5.0, 30.0]))
    now = 0.0
    owner: dict[int, str] = {}  # slot -> the allocation (lease id) holding it
    held: dict[str, float] = {}  # lease id -> READ grace end (while it may run)
    copying: set[str] = set()
    for i in range(150):
        now += rng.choice([0.0, 0.5, 2.0, 7.0])
        lid = f"l{rng.randrange(12)}"
        op = rng.choice(["spill", "spill", "spilled", "spilled", "failed", "offer", "offer",
                         "renew", "release", "tick"])
        before = (t.num_free, len(t))
        freed: list[SlotsFreed] = []
        alloc: tuple[str, tuple[int, ...]] | None = None
        try:
            if op == "spill":
                new = f"{lid}-{i}"
                spill, freed = t.spill(lease(new, rng.randint(1, max(1, n // 2 + 1)), now), now)
                if spill is None:
                    assert not freed or all(f.reason is not TierEnd.EVICTED for f in freed)
                else:
                    alloc = (new, spill.slots)
                    copying.add(new)
            else:
                known = sorted(set(owner.values()))  # live, draining or copying
                pool = sorted(copying) if op in ("spilled", "failed") and copying else known
                target = rng.choice(pool) if pool and rng.random() < 0.9 else lid
                if op == "spilled":
                    _, freed = t.spilled(target, now)
                    copying.discard(target)
                elif op == "failed":
                    freed = t.copy_failed(target, now)
                    copying.discard(target)
                elif op == "offer":
                    e = t.offer(target, now, rng.choice([1.0, 4.0]))
                    held[target] = e.held_until
                elif op == "renew":
                    t.renew(target, now)
                elif op == "release":
                    freed = t.release(target, now)
                else:
                    freed = t.tick(now)
        except TierError:
            assert (t.num_free, len(t)) == before  # a refusal changes nothing
        for f in freed:
            assert f.lease_id not in copying, "slots of a running copy came back"
            if f.reason is TierEnd.EVICTED:
                assert held.get(f.lease_id, float("-inf")) <= now, "evicted under a READ"
            elif f.reason is not TierEnd.COPY_FAILED:
                assert held.get(f.lease_id, float("-inf")) <= now, "reused under a READ"
            for s in f.slots:
                assert owner.pop(s) == f.lease_id, "slots came back twice or to another"
        if alloc is not None:  # after what the same spill evicted came back
            for s in alloc[1]:
                assert s not in owner, "a slot handed out twice"
                owner[s] = alloc[0]
        # the partition: free + owned by entries + draining == every slot, no overlap
        live = {s for lid2 in set(owner.values()) if (e := t.get(lid2)) for s in e.slots}
        assert t.num_free + len(owner) == n
        assert len(live) + t.num_draining == len(owner)
