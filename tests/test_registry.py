"""Router conversation registry: tenants, expiry, LRU, ids, sticky D choice."""

from __future__ import annotations

import pytest

from kvferry.router.conversations.registry import (
    ANONYMOUS,
    ConversationEntry,
    ConversationRegistry,
    api_key_from,
    conversation_id_from,
    tenant_of,
)
from kvferry.router.fleet.upstreams import choose_decode


def entry(lease="L1", expiry=100.0, d="d0") -> ConversationEntry:
    return ConversationEntry(f"http://{d}", d, lease, expiry, 256,
                             {"lease_id": lease, "block_ids": [1, 2]}, ("h1",))


def test_get_update_and_tenant_isolation():
    r = ConversationRegistry()
    assert r.get("t1", "c", 0.0) is None
    assert r.update("t1", "c", entry()) == []
    assert r.get("t1", "c", 0.0) == entry()
    assert r.get("t2", "c", 0.0) is None  # same conversation id, other tenant
    assert r.get("t1", "c2", 0.0) is None
    assert r.size == 1 and len(r) == 1


def test_expired_never_returned_boundary():
    r = ConversationRegistry()
    r.update("t", "c", entry(expiry=10.0))
    assert r.get("t", "c", 9.999) is not None
    assert r.get("t", "c", 10.0) is None
    assert r.size == 0  # dropped on access


def test_update_replaces_and_returns_displaced_lease():
    r = ConversationRegistry()
    r.update("t", "c", entry("L1"))
    assert r.update("t", "c", entry("L1", expiry=200.0)) == []  # same lease: nothing to release
    assert r.update("t", "c", entry("L2")) == [entry("L1", expiry=200.0)]
    assert r.get("t", "c", 0.0).lease_id == "L2"


def test_failed_turn_keeps_entry():
    # The router only calls update on success; a failed turn does nothing, so the old
    # entry is still served next turn.
    r = ConversationRegistry()
    r.update("t", "c", entry("L1"))
    assert r.get("t", "c", 50.0).lease_id == "L1"


def test_lru_bound():
    r = ConversationRegistry(max_entries=2)
    r.update("t", "a", entry("La"))
    r.update("t", "b", entry("Lb"))
    r.get("t", "a", 0.0)  # a is now most recent
    assert r.update("t", "c", entry("Lc")) == [entry("Lb")]
    assert r.get("t", "b", 0.0) is None and r.get("t", "a", 0.0) is not None
    with pytest.raises(ValueError):
        ConversationRegistry(0)


def test_drop():
    r = ConversationRegistry()
    r.update("t", "a", entry("La", expiry=10.0))
    r.update("t", "c", entry("Lc", expiry=30.0, d="d1"))
    assert r.drop("t", "c") == entry("Lc", expiry=30.0, d="d1")
    assert r.drop("t", "c") is None
    assert r.size == 1 and r.get("t", "a", 0.0) == entry("La", expiry=10.0)


def test_renewed_moves_expiry_only_for_same_lease():
    r = ConversationRegistry()
    r.update("t", "c", entry("L1", expiry=10.0))
    assert r.renewed("t", "c", "L1", 50.0)
    assert r.get("t", "c", 40.0).expiry == 50.0
    assert not r.renewed("t", "c", "OLD", 500.0)
    assert not r.renewed("t", "x", "L1", 500.0)
    assert r.renewed("t", "c", "L1", 5.0) and r.get("t", "c", 0.0).expiry == 50.0


def test_conversation_id_sources_and_order():
    assert conversation_id_from({"conversation_id": "c1", "session_id": "s"}, {}) == "c1"
    assert conversation_id_from({"session_id": "s"}, {"X-Session-ID": "h"}) == "s"
    assert conversation_id_from({"prompt_cache_key": "k"}, None) == "k"
    assert conversation_id_from({"metadata": {"session_id": "m"}}, None) == "m"
    assert conversation_id_from({}, {"x-conversation-id": "a", "x-session-id": "b"}) == "a"
    assert conversation_id_from(None, {"X-CLAUDE-CODE-SESSION-ID": "cc"}) == "cc"
    assert conversation_id_from(None, [("Session_Id", "codex")]) == "codex"
    assert conversation_id_from({"conversation_id": 42}, None) == "42"
    assert conversation_id_from({"user": "alice"}, {}) is None  # deliberately not used
    assert conversation_id_from(None, None) is None


@pytest.mark.parametrize("bad", ["", "   ", "x" * 257, "a\nb", True, None, ["x"], 1.5])
def test_conversation_id_rejects_malformed(bad):
    assert conversation_id_from({"conversation_id": bad}, {"x-session-id": "ok"}) == "ok"


def test_tenant_and_api_key():
    assert tenant_of(None) == ANONYMOUS and tenant_of("") == ANONYMOUS
    t = tenant_of("sk-abc")
    assert t == tenant_of("sk-abc") and t != tenant_of("sk-abd") and "sk-abc" not in t
    assert tenant_of("sk-abc", b"secret") != t
    assert api_key_from({"Authorization": "Bearer sk-1"}) == "sk-1"
    assert api_key_from({"authorization": "bearer  sk-2 "}) == "sk-2"
    assert api_key_from({"X-Api-Key": "k"}) == "k"
    assert api_key_from({"Authorization": "Basic xyz"}) is None
    assert api_key_from(None) is None


def test_choose_decode_sticky_and_fallbacks():
    loads = {"d0": 3.0, "d1": 1.0, "d2": 1.0}
    assert choose_decode("d0", loads) == "d0"  # 3 <= max(2*1, 1+2)
    assert choose_decode("d0", {**loads, "d0": 3.5}) == "d1"  # overloaded: least, by name
    assert choose_decode("d0", loads, healthy={"d1", "d2"}) == "d1"
    assert choose_decode(None, loads) == "d1"
    assert choose_decode("gone", loads) == "d1"
    assert choose_decode("d0", {"d0": 2.0, "d1": 0.0}) == "d0"  # slack keeps stickiness
    assert choose_decode("d0", {"d0": 2.5, "d1": 0.0}) == "d1"
    assert choose_decode("d0", {"d0": 8.0, "d1": 4.0}, factor=2.0) == "d0"
    assert choose_decode("d0", loads, healthy=set()) is None
    assert choose_decode("d0", {}) is None
