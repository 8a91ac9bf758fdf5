"""Scheduler-side pull logic: which requests read, which blocks P keeps, and for how long.

Plain state with no vLLM imports and no I/O, so it is unit-testable: the vLLM glue
(`connector.py`) turns scheduler callbacks into calls here and ships `StepMeta` to the
workers each step.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvferry.connectors.params import (
    InvalidParams,
    RemotePrefill,
    blocks_needed,
    parse_offer,
    prompt_hash,
    sign,
)

log = logging.getLogger("vllm." + __name__)  # under vLLM's handlers


@dataclass
class RecvTask:
    """D reads ``remote_block_ids`` from P into ``local_block_ids`` (same order)."""

    req_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    offer: RemotePrefill
    release_only: bool = False  # nothing to read: just tell P to free its blocks


@dataclass
class StepMeta:
    """Scheduler -> workers, once per engine step."""

    recv: list[RecvTask] = field(default_factory=list)
    send: list[str] = field(default_factory=list)  # P: request ids whose blocks wait for D


@dataclass
class _Pending:
    offer: RemotePrefill
    local_hit_tokens: int
    num_tokens: int


class PullScheduler:
    def __init__(self, engine_id: str, host: str, port: int, block_size: int, tp_size: int = 1):
        self.engine_id = engine_id
        self.host = host
        self.port = port
        self.block_size = block_size
        self.tp_size = tp_size
        self._offers: dict[str, _Pending] = {}
        self._rejected: dict[str, str] = {}
        self._meta = StepMeta()
        self.waiting_send: set[str] = set()  # P: delayed-free requests not yet reported

    # -- D side ------------------------------------------------------------------------
    def matched_tokens(self, req_id: str, prompt: Sequence[int], params: Mapping[str, Any] | None,
                       num_computed: int) -> tuple[int, bool]:
        """Tokens D will load from P (async) beyond its own prefix-cache hit."""
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        pend = self._offers.get(req_id)
        if pend is None:
            if req_id in self._rejected:
                return 0, False
            try:
                offer = self._validate(prompt, params)
            except InvalidParams as e:
                self._rejected[req_id] = str(e)
                log.warning("request %s: recomputing locally, offer rejected: %s", req_id, e)
                return 0, False
            pend = self._offers[req_id] = _Pending(offer, num_computed, len(prompt))
        pend.local_hit_tokens = num_computed
        count = pend.num_tokens - num_computed
        return (count, True) if count > 0 else (0, False)

    def _validate(self, prompt: Sequence[int], params: Mapping[str, Any]) -> RemotePrefill:
        offer = parse_offer(params)
        if offer.remote_num_tokens != len(prompt) or offer.prompt_hash != prompt_hash(prompt):
            raise InvalidParams("offer is for a different prompt (token mismatch)")
        if blocks_needed(len(prompt), self.block_size) > len(offer.remote_block_ids):
            raise InvalidParams(
                f"offer has {len(offer.remote_block_ids)} blocks for {len(prompt)} tokens"
            )
        if offer.remote_tp_size != self.tp_size:
            raise InvalidParams(f"prefill TP {offer.remote_tp_size} != decode TP {self.tp_size}")
        return offer

    def after_alloc(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """Blocks exist for the request: queue the READ (or a release if nothing to read)."""
        pend = self._offers.pop(req_id, None)
        if pend is None:
            return
        hit = pend.local_hit_tokens // self.block_size
        need = blocks_needed(pend.num_tokens, self.block_size)
        if num_external <= 0 or hit >= need:
            self._meta.recv.append(RecvTask(req_id, [], [], pend.offer, release_only=True))
            return
        local = list(block_ids[hit:need])
        remote = list(pend.offer.remote_block_ids[hit:need])
        if len(local) != len(remote):
            log.warning("request %s: %d local blocks for %d remote; recomputing", req_id,
                        len(local), len(remote))
            self._meta.recv.append(RecvTask(req_id, [], [], pend.offer, release_only=True))
            return
        self._meta.recv.append(RecvTask(req_id, local, remote, pend.offer))

    def rejection(self, req_id: str) -> str | None:
        return self._rejected.get(req_id)

    # -- both sides --------------------------------------------------------------------
    def finished(self, req_id: str, ok: bool, block_ids: Sequence[int], params: Mapping[str, Any] | None,
                 prompt: Sequence[int], transfer_id: str = "") -> tuple[bool, dict[str, Any] | None]:
        """P: keep a finished prefill's blocks for D and publish the signed offer."""
        self._rejected.pop(req_id, None)
        pend = self._offers.pop(req_id, None)
        if pend is not None:  # D request ended before its blocks were allocated
            self._meta.recv.append(RecvTask(req_id, [], [], pend.offer, release_only=True))
        # A D request aborted mid-READ needs nothing here: vLLM keeps its blocks until the
        # worker reports the READ finished (done or failed).
        if not params or not params.get("do_remote_decode") or not ok or not block_ids:
            return False, None
        offer = RemotePrefill(
            remote_engine_id=self.engine_id, remote_host=self.host, remote_port=self.port,
            remote_block_ids=list(block_ids), remote_request_id=req_id,
            remote_num_tokens=len(prompt), prompt_hash=prompt_hash(prompt),
            remote_tp_size=self.tp_size, transfer_id=str(params.get("transfer_id", "")),
        )
        self._meta.send.append(req_id)
        self.waiting_send.add(req_id)
        return True, sign(offer)

    def worker_done(self, sent: set[str]) -> None:
        """Workers reported finished sends: P's blocks are free again."""
        self.waiting_send -= sent

    def take_meta(self) -> StepMeta:
        meta, self._meta = self._meta, StepMeta()
        return meta
