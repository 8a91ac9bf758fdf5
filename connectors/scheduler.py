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
class RegisterTask:
    """Push, D: tell P where to write ``transfer_id``'s KV (tokens from ``first_token``)."""

    req_id: str
    transfer_id: str
    host: str
    port: int
    block_ids: list[int]
    first_token: int
    num_tokens: int
    prompt_hash: str


@dataclass
class PushSend:
    """Push, P: prefill of ``transfer_id`` done; its blocks wait for D's registration."""

    req_id: str
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    prompt_hash: str


@dataclass
class StepMeta:
    """Scheduler -> workers, once per engine step."""

    recv: list[RecvTask] = field(default_factory=list)
    send: list[str] = field(default_factory=list)  # P: request ids whose blocks wait for D
    register: list[RegisterTask] = field(default_factory=list)  # push, D
    push_send: list[PushSend] = field(default_factory=list)  # push, P
    push_abort_p: list[str] = field(default_factory=list)  # push, P: transfer ids cancelled
    push_abort_d: list[str] = field(default_factory=list)  # push, D: transfer ids cancelled

    def has_push(self) -> bool:
        return bool(self.register or self.push_send or self.push_abort_p or self.push_abort_d)


@dataclass
class _PushPending:
    transfer_id: str
    host: str
    port: int
    local_hit_tokens: int
    num_tokens: int
    prompt_hash: str


@dataclass
class _Pending:
    offer: RemotePrefill
    local_hit_tokens: int
    num_tokens: int


class TransferScheduler:
    """Scheduler-side state of one engine, for pull and push (P and D roles alike)."""

    def __init__(self, engine_id: str, host: str, port: int, block_size: int, tp_size: int = 1):
        self.engine_id = engine_id
        self.host = host
        self.port = port
        self.block_size = block_size
        self.tp_size = tp_size
        self._offers: dict[str, _Pending] = {}
        self._rejected: dict[str, str] = {}
        self._meta = StepMeta()
        self._push: dict[str, _PushPending] = {}  # D: push requests before allocation
        self.push_waiting: dict[str, str] = {}  # D: req id -> transfer id awaiting P's WRITE
        self.waiting_send: set[str] = set()  # P: delayed-free requests not yet reported

    # -- D side ------------------------------------------------------------------------
    def matched_tokens(self, req_id: str, prompt: Sequence[int], params: Mapping[str, Any] | None,
                       num_computed: int) -> tuple[int, bool]:
        """Tokens D will load from P (async) beyond its own prefix-cache hit."""
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        if params.get("push"):
            return self._push_matched(req_id, prompt, params, num_computed)
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

    def _push_matched(self, req_id: str, prompt: Sequence[int], params: Mapping[str, Any],
                      num_computed: int) -> tuple[int, bool]:
        """Push: D will receive P's WRITE for everything beyond its own prefix hit."""
        pend = self._push.get(req_id)
        if pend is None:
            if req_id in self._rejected:
                return 0, False
            tid, host, port = params.get("transfer_id"), params.get("remote_host"), params.get("remote_port")
            if not (isinstance(tid, str) and tid and isinstance(host, str)
                    and isinstance(port, int) and 0 < port < 65536):
                self._rejected[req_id] = "push params need transfer_id, remote_host, remote_port"
                log.warning("request %s: recomputing locally: %s", req_id, self._rejected[req_id])
                return 0, False
            pend = self._push[req_id] = _PushPending(tid, host, port, num_computed, len(prompt),
                                                     prompt_hash(prompt))
        pend.local_hit_tokens = num_computed
        count = pend.num_tokens - num_computed
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """Blocks exist for the request: queue the READ (or a release if nothing to read)."""
        push = self._push.pop(req_id, None)
        if push is not None:
            hit = push.local_hit_tokens // self.block_size
            need = blocks_needed(push.num_tokens, self.block_size)
            if num_external <= 0 or hit >= need:  # nothing to receive: P may free at once
                self._meta.push_abort_d.append(push.transfer_id)
                return
            self._meta.register.append(RegisterTask(
                req_id, push.transfer_id, push.host, push.port, list(block_ids[hit:need]),
                hit * self.block_size, push.num_tokens, push.prompt_hash))
            self.push_waiting[req_id] = push.transfer_id
            return
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
        push = self._push.pop(req_id, None)
        if push is not None:  # D push request ended before allocation: P may free
            self._meta.push_abort_d.append(push.transfer_id)
        if (tid := self.push_waiting.pop(req_id, None)) is not None:
            # Aborted while P's WRITE may still land: vLLM keeps the blocks until the
            # worker reports this request received, which it does once no WRITE can land.
            self._meta.push_abort_d.append(tid)
        pend = self._offers.pop(req_id, None)
        if pend is not None:  # D request ended before its blocks were allocated
            self._meta.recv.append(RecvTask(req_id, [], [], pend.offer, release_only=True))
        # A D request aborted mid-READ needs nothing here: vLLM keeps its blocks until the
        # worker reports the READ finished (done or failed).
        if not params or not params.get("do_remote_decode"):
            return False, None
        if params.get("push"):
            tid = str(params.get("transfer_id", ""))
            if not ok or not block_ids or not tid:
                if tid:
                    self._meta.push_abort_p.append(tid)
                return False, None
            self._meta.push_send.append(PushSend(req_id, tid, list(block_ids), len(prompt),
                                                 prompt_hash(prompt)))
            self.waiting_send.add(req_id)
            return True, {"transfer_id": tid, "push": True}
        if not ok or not block_ids:
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

    def worker_done(self, sent: set[str], recvd: set[str] = frozenset()) -> None:
        """Workers reported finished sends (P's blocks free) and receives (D)."""
        self.waiting_send -= sent
        for req_id in recvd:
            self.push_waiting.pop(req_id, None)

    def take_meta(self) -> StepMeta:
        meta, self._meta = self._meta, StepMeta()
        return meta
