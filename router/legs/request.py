"""One client request on its way through the legs, built once by `flow.run_request` and
passed down: every step reads what it needs from it instead of a long argument list."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from ..conversations.turn import Turn
from ..settings import Mode
from ..wire.bodies import wants_stream
from .context import forward_headers


@dataclass
class RouterRequest:
    """What the client asked, and this pass's transfer through a P/D pair."""

    endpoint: str  # "completions" or "chat"
    path: str  # the engine path the legs POST to
    body: dict[str, Any]  # the client's body, router-owned fields removed
    client_headers: Any
    mode: Mode
    started: float  # when the request arrived (perf_counter)
    turn: Turn | None = None  # its conversation turn, if any
    transfer_id: str = ""  # this pass's transfer (one per P/D pair tried)
    headers: dict[str, str] = field(default_factory=dict)  # both legs' headers (this pass)
    broken: frozenset[str] = frozenset()  # Ds that broke this request before it answered
    stream: bool = field(init=False)

    def __post_init__(self) -> None:
        self.stream = wants_stream(self.body)

    def next_pass(self, broken: frozenset[str]) -> RouterRequest:
        """The request on a fresh transfer, avoiding the Ds in `broken`."""
        return self.with_transfer(uuid.uuid4().hex, broken)

    def with_transfer(self, transfer_id: str, broken: frozenset[str] | None = None) -> RouterRequest:
        """The same request under another transfer id (a retry starts a fresh transfer)."""
        return replace(self, transfer_id=transfer_id,
                       headers=forward_headers(self.client_headers, transfer_id),
                       broken=self.broken if broken is None else broken)
