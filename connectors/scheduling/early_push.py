"""Early push, P's scheduler side: which push prefills may start their WRITE as soon as the
forward computing their last prompt tokens is complete, a step before vLLM finishes them.

Only single-token requests (the router's P leg): vLLM finishes them in the step that
computes the prompt, so their blocks stay put from that forward until the request ends,
except for a preemption while that step's output is pending, which the next step's meta
reports (`StepMeta.push_preempted`) before any WRITE starts. A preempted request takes
the normal path (its push_send when it finishes).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvferry.connectors.protocol import timeline
from kvferry.connectors.protocol.params import KvParams, blocks_needed, prompt_hash
from kvferry.connectors.protocol.step import PushSend, StepMeta

log = logging.getLogger("vllm." + __name__)  # under vLLM's handlers


@dataclass
class _PushPrefill:
    """A single-token push prefill being computed, and its blocks so far."""

    transfer_id: str
    num_tokens: int
    prompt_hash: str
    blocks: list[int] = field(default_factory=list)


class EarlyPush:
    """P's scheduler: the push prefills whose WRITE may start once their last prompt
    forward is complete (`StepMeta.push_ready`), and those preempted since (`push_preempted`)."""

    def __init__(self, block_size: int, enabled: bool) -> None:
        self.block_size = block_size
        self.enabled = enabled
        self._tracked: dict[str, _PushPrefill] = {}  # until the last chunk is scheduled
        self.pushed: dict[str, str] = {}  # req id -> transfer id handed to the workers
        self._no_early: set[str] = set()  # preempted after an early push: the normal path

    def track(self, req_id: str, prompt: Sequence[int], kp: KvParams, max_tokens: int | None) -> None:
        """Follow a push prefill whose forward may start its WRITE."""
        if (not self.enabled or max_tokens != 1 or not kp.do_remote_decode or not kp.push
                or not kp.transfer_id or req_id in self._tracked or req_id in self.pushed
                or req_id in self._no_early):
            return
        self._tracked[req_id] = _PushPrefill(kp.transfer_id, len(prompt), prompt_hash(prompt))

    def tracks(self) -> bool:
        return bool(self._tracked or self.pushed)

    def allocated(self, req_id: str, block_ids: Sequence[int]) -> None:
        if (pp := self._tracked.get(req_id)) is not None:
            pp.blocks = list(block_ids)

    def plan(self, progress: Mapping[str, tuple[int, int]],
             grown: Mapping[str, tuple[Sequence[int], bool]], preempted: set[str],
             now: float, meta: StepMeta) -> None:
        """This step's scheduler output -> `StepMeta.push_ready` / `push_preempted`."""
        for req_id in preempted:
            if req_id in self._tracked or req_id in self.pushed:
                self._no_early.add(req_id)  # resumed, it pushes when it finishes
            self._tracked.pop(req_id, None)
            if (tid := self.pushed.pop(req_id, None)) is not None:
                meta.push_preempted.append((tid, req_id))
        for req_id, (ids, replace) in grown.items():
            if (pp := self._tracked.get(req_id)) is not None:
                pp.blocks = list(ids) if replace else pp.blocks + list(ids)
        for req_id, (computed, n) in progress.items():
            pp = self._tracked.get(req_id)
            if pp is None or n <= 0 or computed + n < pp.num_tokens:
                continue
            del self._tracked[req_id]
            if len(pp.blocks) < blocks_needed(pp.num_tokens, self.block_size):
                log.warning("request %s: %d blocks known for %d tokens; pushing when it ends",
                            req_id, len(pp.blocks), pp.num_tokens)
                continue
            self.pushed[req_id] = pp.transfer_id
            timeline.mark(log, pp.transfer_id, "last_chunk_scheduled", now)
            meta.push_ready.append(PushSend(req_id, pp.transfer_id, list(pp.blocks),
                                            pp.num_tokens, pp.prompt_hash, now))

    def forget(self, req_id: str) -> bool:
        """The request ended; True if its WRITE was handed to the workers early."""
        self._tracked.pop(req_id, None)
        self._no_early.discard(req_id)
        return self.pushed.pop(req_id, None) is not None
