"""The router's conversation registry: where each conversation's reusable KV lives on D.

Bidirectional reuse needs someone to remember, between turns, which D holds a
conversation's KV and under which lease. The router learns it from D's response stream
and hands it to P on the next turn. Only block locations are stored, never tensors.

Keys are (tenant, conversation_id): the tenant is a hash of the API key, so one tenant
can never reach another's entry even with the same conversation id. The registry is
bounded (LRU over ``max_entries``) and never returns an entry whose lease expired.
Entries are replaced only after a successful turn: a failed turn leaves the previous
turn's entry (and lease) usable. Entries the registry lets go of are returned so the
router can tell D to release their leases early.

Pure: no I/O, no clocks (``now`` is passed in).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

ANONYMOUS = "anonymous"
MAX_CONVERSATION_ID_LEN = 256

# Where clients put a conversation/session id, checked in this order. Body fields first
# (explicit API), then headers agents send (matched case-insensitively):
# - conversation_id: kvferry's own field; session_id: common agent SDK field;
# - prompt_cache_key: OpenAI's field for cache-affinity routing, same intent;
# - metadata.{conversation_id,session_id}: OpenAI-style request metadata;
# - X-Conversation-ID / X-Session-ID: generic proxy conventions;
# - X-Claude-Code-Session-Id: Claude Code; conversation_id / session_id: Codex CLI.
# Deliberately NOT ``user``: one user runs many conversations at once, and keying by it
# would make them overwrite (and release) each other's entries.
BODY_FIELDS: tuple[str, ...] = ("conversation_id", "session_id", "prompt_cache_key")
METADATA_FIELDS: tuple[str, ...] = ("conversation_id", "session_id")
SESSION_HEADERS: tuple[str, ...] = (
    "x-conversation-id",
    "x-session-id",
    "x-claude-code-session-id",
    "conversation_id",
    "session_id",
)


def _clean_id(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    s = str(value).strip()
    if not s or len(s) > MAX_CONVERSATION_ID_LEN or not s.isprintable():
        return None
    return s


def _header_items(headers: Mapping[str, str] | Iterable[tuple[str, str]] | None
                  ) -> dict[str, str]:
    if headers is None:
        return {}
    items = headers.items() if isinstance(headers, Mapping) else headers
    out: dict[str, str] = {}
    for k, v in items:
        out.setdefault(str(k).lower(), v)
    return out


def conversation_id_from(body: Mapping[str, Any] | None,
                         headers: Mapping[str, str] | Iterable[tuple[str, str]] | None
                         ) -> str | None:
    """The request's conversation id, or None (then the request gets no reuse).

    Malformed values (empty, non-printable, over 256 chars) are skipped, not errors.
    """
    body = body or {}
    for name in BODY_FIELDS:
        if (cid := _clean_id(body.get(name))) is not None:
            return cid
    meta = body.get("metadata")
    if isinstance(meta, Mapping):
        for name in METADATA_FIELDS:
            if (cid := _clean_id(meta.get(name))) is not None:
                return cid
    h = _header_items(headers)
    for name in SESSION_HEADERS:
        if (cid := _clean_id(h.get(name))) is not None:
            return cid
    return None


def api_key_from(headers: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> str | None:
    """The caller's API key: ``Authorization: Bearer KEY`` or ``x-api-key: KEY``."""
    h = _header_items(headers)
    auth = h.get("authorization", "")
    if auth[:7].lower() == "bearer " and auth[7:].strip():
        return auth[7:].strip()
    key = h.get("x-api-key", "").strip()
    return key or None


def tenant_of(api_key: str | None, secret: bytes = b"") -> str:
    """Stable tenant id: a hash of the API key (never the key itself), or "anonymous"."""
    if not api_key:
        return ANONYMOUS
    h = hashlib.sha256(secret + b"\0" + api_key.encode())
    return "t-" + h.hexdigest()[:32]


@dataclass(frozen=True)
class ConversationEntry:
    """Where the conversation's last successful turn left its KV."""

    decode_url: str
    engine_id: str
    lease_id: str
    expiry: float  # D's lease expiry, on the router's clock
    num_tokens: int
    kv_transfer_params: Mapping[str, Any] = field(default_factory=dict)  # locations only
    prefix_hashes: tuple[str, ...] = ()
    history: Mapping[str, Any] = field(default_factory=dict)  # history.record: what D holds


class ConversationRegistry:
    """(tenant, conversation_id) -> ConversationEntry, LRU-bounded, expiry-aware."""

    def __init__(self, max_entries: int = 100_000) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be positive")
        self.max_entries = max_entries
        self._d: OrderedDict[tuple[str, str], ConversationEntry] = OrderedDict()

    def get(self, tenant: str, conversation_id: str, now: float) -> ConversationEntry | None:
        """The live entry, or None; an expired entry is dropped on the way."""
        key = (tenant, conversation_id)
        e = self._d.get(key)
        if e is None:
            return None
        if now >= e.expiry:
            del self._d[key]
            return None
        self._d.move_to_end(key)
        return e

    def update(self, tenant: str, conversation_id: str, entry: ConversationEntry
               ) -> list[ConversationEntry]:
        """Record a successful turn. Returns entries let go (replaced under another lease,
        or evicted as least recently used) whose leases the router should release."""
        key = (tenant, conversation_id)
        out: list[ConversationEntry] = []
        old = self._d.pop(key, None)
        if old is not None and old.lease_id != entry.lease_id:
            out.append(old)
        self._d[key] = entry
        while len(self._d) > self.max_entries:
            out.append(self._d.popitem(last=False)[1])
        return out

    def renewed(self, tenant: str, conversation_id: str, lease_id: str, expiry: float) -> bool:
        """D renewed the lease: move the entry's expiry (only if it is still that lease)."""
        key = (tenant, conversation_id)
        e = self._d.get(key)
        if e is None or e.lease_id != lease_id:
            return False
        self._d[key] = replace(e, expiry=max(e.expiry, expiry))
        return True

    def drop(self, tenant: str, conversation_id: str) -> ConversationEntry | None:
        """Forget the conversation; returns the entry so D can be told to release it."""
        return self._d.pop((tenant, conversation_id), None)

    @property
    def size(self) -> int:
        return len(self._d)

    def held(self) -> list[tuple[str, str]]:
        """Every (tenant, conversation id or content key) held, oldest use first: what an
        operator or a test may enumerate without reaching into the LRU itself."""
        return list(self._d)

    def __len__(self) -> int:
        return len(self._d)
