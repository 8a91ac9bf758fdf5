"""One conversation turn as the router tracks it, from the request to D's commit.

Its own module so that `conversations.py` (the registry's front) and `continuation.py`
(content-keyed turns) can both build turns without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvferry.connectors.protocol import params as kv

from . import history
from .registry import ConversationEntry


@dataclass
class Turn:
    """One request of a conversation, from its arrival to the commit of what D holds."""

    tenant: str
    conversation_id: str
    lease_id: str
    entry: ConversationEntry | None  # the previous turn's KV, if still leased
    view: history.PromptView | None = None  # the request's prompt (route policy, content keys)
    history: dict[str, Any] | None = None  # what D holds once this turn answered
    continues: str | None = None  # content-keyed: the key of the entry this turn continues
    content: bool = False  # keyed by content: conversation_id is set once D answered

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant, self.conversation_id)

    def prefill_params(self) -> dict[str, Any]:
        """Extra kv_transfer_params for P: D's signed lease offer (history to READ)."""
        return kv.reuse_params(self.entry.kv_transfer_params) if self.entry else {}

    def lease_request(self, ttl: float | None) -> dict[str, Any]:
        return kv.lease_params(self.lease_id, ttl)
