"""Host staging as the transfer thread sees it: copies around a transfer, when there are any.

Neuron without device registration moves KV through a pinned DRAM mirror
(kvferry.neuron.staging.HostStaging): what arrives (a READ here, a push WRITE) reaches the
device before it is reported received; what leaves is copied out before a peer can read
it (a push WRITE right before posting; a pull offer's blocks by `TransferWorker.save` on
the engine thread). Without staging (cpu, cuda, Neuron device mode) every call is a no-op.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from kvferry.connectors.transfer.stats import Stats

log = logging.getLogger("vllm." + __name__)  # under vLLM's handlers


class Staging(Protocol):
    """Host staging as the worker uses it (kvferry.neuron.staging.HostStaging)."""

    def stage_out(self, block_ids: Iterable[int]) -> Any: ...
    def stage_in(self, block_ids: Iterable[int]) -> Any: ...


class Mirror:
    """The transfer thread's view of host staging: copy in after a transfer lands, out
    before a peer may read; a no-op without staging."""

    def __init__(self, staging: Staging | None = None, stats: Stats | None = None) -> None:
        self.staging = staging  # None: KV moves straight from/to the registered layout
        self.stats = stats

    @property
    def active(self) -> bool:
        return self.staging is not None

    def stage_in(self, req_id: str, block_ids: Sequence[int]) -> bool:
        """Blocks that landed in the host mirror -> device, before they are reported
        received. False (logged) if the copy failed: report them bad."""
        if self.staging is None or not block_ids:
            return True
        try:
            self.staging.stage_in(block_ids)
        except Exception as e:
            log.warning("request %s: host -> device copy of %d blocks failed (%s); recomputing",
                        req_id, len(block_ids), e)
            if self.stats is not None:
                self.stats.event("recomputes", req_id, f"host -> device copy failed: {e}")
            return False
        return True

    def stage_out(self, block_ids: Sequence[int]) -> None:
        """Device -> host mirror before a peer reads it or our WRITE does. Raises on
        failure: a stale mirror would be a wrong answer."""
        if self.staging is not None and block_ids:
            self.staging.stage_out(block_ids)
