"""A conversation entry as bytes, for the stores outside this process (Redis, the workers'
SQLite file): JSON, and anything unreadable (another version's, corrupt) reads as none."""

from __future__ import annotations

import json

from .registry import ConversationEntry


def encode_entry(entry: ConversationEntry) -> bytes:
    return json.dumps({
        "decode_url": entry.decode_url, "engine_id": entry.engine_id, "lease_id": entry.lease_id,
        "expiry": entry.expiry, "num_tokens": entry.num_tokens,
        "kv_transfer_params": dict(entry.kv_transfer_params),
        "prefix_hashes": list(entry.prefix_hashes), "history": dict(entry.history),
    }, separators=(",", ":")).encode()


def decode_entry(raw: bytes | str | None) -> ConversationEntry | None:
    """The entry in `raw`, or None for anything unreadable (another version's, corrupt)."""
    if raw is None:
        return None
    try:
        d = json.loads(raw)
        return ConversationEntry(
            decode_url=str(d["decode_url"]), engine_id=str(d["engine_id"]),
            lease_id=str(d["lease_id"]), expiry=float(d["expiry"]),
            num_tokens=int(d["num_tokens"]), kv_transfer_params=dict(d["kv_transfer_params"]),
            prefix_hashes=tuple(d.get("prefix_hashes") or ()),
            history=dict(d.get("history") or {}))
    except (ValueError, KeyError, TypeError):
        return None
