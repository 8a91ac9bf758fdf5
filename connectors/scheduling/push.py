"""Push, scheduler side. D: once its blocks exist, register them with P (`RegisterTask`)
and wait for P's WRITE. P: hand the finished prefill to the workers (`PushSend`), which
WRITE it once D's registration arrived (or the early push did already).

Every D push request ends in a registration or an abort of its transfer id, so P never
holds blocks for a registration that cannot come longer than its hold timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvferry.connectors.protocol import timeline
from kvferry.connectors.protocol.params import (
    InvalidParams,
    KvParams,
    blocks_needed,
    prompt_hash,
    push_answer,
)
from kvferry.connectors.protocol.step import PushSend, RegisterTask, StepMeta

log = logging.getLogger("vllm." + __name__)  # under vLLM's handlers


@dataclass
class _PushPending:
    transfer_id: str
    host: str
    port: int
    local_hit_tokens: int
    num_tokens: int
    prompt_hash: str


@dataclass(frozen=True)
class PushFinish:
    """P's decision for a finished push prefill: keep its blocks (the workers report them
    freed) and what to return in its kv_transfer_params."""

    keep: bool
    params: dict | None = None


class PushPlanner:
    """Push on both sides' schedulers: D's registrations (`RegisterTask`) and their end,
    P's finished prefills handed to the workers (`PushSend`)."""

    def __init__(self, block_size: int, clock: Callable[[], float]) -> None:
        self.block_size = block_size
        self.clock = clock
        self._push: dict[str, _PushPending] = {}  # D: push requests before allocation
        self.rejected: dict[str, InvalidParams] = {}  # D: req id -> why it will not be pushed to
        self.waiting: dict[str, str] = {}  # D: req id -> transfer id awaiting P's WRITE
        self.landed: dict[str, str] = {}  # D, timeline only: KV in, first step not yet planned
        self.stepping: dict[str, str] = {}  # D, timeline only: first step planned, no token yet

    # -- D ----------------------------------------------------------------------------------
    def matched(self, req_id: str, prompt: Sequence[int], kp: KvParams,
                num_computed: int) -> tuple[int, bool]:
        """D will receive P's WRITE for everything beyond its own prefix hit."""
        pend = self._push.get(req_id)
        if pend is None:
            if req_id in self.rejected:
                return 0, False
            if not (kp.transfer_id and kp.remote_host and 0 < kp.remote_port < 65536):
                self.rejected[req_id] = InvalidParams(
                    "push params need transfer_id, remote_host, remote_port", "push_incomplete")
                log.warning("request %s: recomputing locally: %s", req_id, self.rejected[req_id])
                return 0, False
            pend = self._push[req_id] = _PushPending(kp.transfer_id, kp.remote_host, kp.remote_port,
                                                     num_computed, len(prompt), prompt_hash(prompt))
        pend.local_hit_tokens = num_computed
        count = pend.num_tokens - num_computed
        return (count, True) if count > 0 else (0, False)

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external: int,
                  meta: StepMeta) -> bool:
        """Blocks exist for a push request: register them (False: not a push request)."""
        push = self._push.pop(req_id, None)
        if push is None:
            return False
        hit = push.local_hit_tokens // self.block_size
        need = blocks_needed(push.num_tokens, self.block_size)
        if num_external <= 0 or hit >= need:  # nothing to receive: P may free at once
            meta.push_abort_d.append(push.transfer_id)
            return True
        meta.register.append(RegisterTask(
            req_id, push.transfer_id, push.host, push.port, list(block_ids[hit:need]),
            hit * self.block_size, push.num_tokens, push.prompt_hash))
        self.waiting[req_id] = push.transfer_id
        return True

    def received(self, req_ids: Iterable[str]) -> None:
        """The workers reported these requests received (timeline: KV seen)."""
        for req_id in req_ids:
            if (tid := self.waiting.pop(req_id, None)) is not None and timeline.ENABLED:
                timeline.mark(log, tid, "kv_seen")
                self.landed[req_id] = tid

    def note_scheduled(self, req_ids: Iterable[str]) -> None:
        """Timeline only: push requests whose first decode step was just scheduled."""
        for req_id in req_ids:
            if (tid := self.landed.pop(req_id, None)) is not None:
                timeline.mark(log, tid, "scheduled")
                self.stepping[req_id] = tid

    def note_outputs(self, output_tokens: Callable[[str], int | None]) -> None:
        """Timeline only, after each step's outputs were processed: push requests whose
        first token now exists in D's engine core (``output_tokens``: a request's output
        token count, None once it is gone), the moment before vLLM sends it to its API
        server."""
        for req_id, tid in list(self.stepping.items()):
            n = output_tokens(req_id)
            if n is None or n > 0:
                del self.stepping[req_id]
                if n:
                    timeline.mark(log, tid, "d_token_out")

    def forget(self, req_id: str, meta: StepMeta) -> None:
        """The request ended: tell P whatever it may now free."""
        self.rejected.pop(req_id, None)
        self.landed.pop(req_id, None)
        self.stepping.pop(req_id, None)
        push = self._push.pop(req_id, None)
        if push is not None:  # D push request ended before allocation: P may free
            meta.push_abort_d.append(push.transfer_id)
        if (tid := self.waiting.pop(req_id, None)) is not None:
            # Aborted while P's WRITE may still land: vLLM keeps the blocks until the
            # worker reports this request received, which it does once no WRITE can land.
            meta.push_abort_d.append(tid)

    # -- P ----------------------------------------------------------------------------------
    def finished(self, req_id: str, ok: bool, block_ids: Sequence[int], kp: KvParams,
                 prompt: Sequence[int], early: bool, meta: StepMeta) -> PushFinish:
        """A push prefill ended (``early``: its WRITE may have started already)."""
        tid = kp.transfer_id
        if not ok or not block_ids or not tid:
            if tid:
                meta.push_abort_p.append((tid, req_id))
            # a WRITE may be reading the blocks: the worker frees them
            return PushFinish(early and bool(tid))
        ended = self.clock()
        timeline.mark(log, tid, "prefill_end", ended)
        meta.push_send.append(PushSend(req_id, tid, list(block_ids), len(prompt),
                                       prompt_hash(prompt), ended))
        return PushFinish(True, push_answer(tid))
