"""Pull, scheduler side: P publishes a signed offer over a finished prefill; D checks it,
allocates blocks and asks its workers to READ them.

D validates the offer once per request (signature, prompt, block count, TP split) and
remembers a rejection, so vLLM's repeated matching calls never retry a bad one. Every
offer D accepted ends in exactly one `RecvTask` (a READ, or a release-only notice when
nothing is read), so P always learns when its blocks may go.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvferry.connectors.protocol.params import (
    InvalidParams,
    KvParams,
    RemotePrefill,
    blocks_needed,
    parse_offer,
    prompt_hash,
    sign,
)
from kvferry.connectors.protocol.step import RecvTask, StepMeta
from kvferry.connectors.protocol.tp_map import split_problem

log = logging.getLogger("vllm." + __name__)  # under vLLM's handlers


def check_split(num_kv_heads: int, src_tp: int, dst_tp: int, src: str, dst: str) -> None:
    """Each rank here will read its heads from the peer ranks holding them: refuse (with
    InvalidParams) when the model's heads do not split over both sizes."""
    if src_tp != dst_tp and (why := split_problem(num_kv_heads, src_tp, dst_tp)) is not None:
        raise InvalidParams(f"{src} TP {src_tp} -> {dst} TP {dst_tp}: {why}", "tp_mismatch")


@dataclass
class _Pending:
    offer: RemotePrefill
    local_hit_tokens: int
    num_tokens: int


class PullPlanner:
    """Pull on both sides' schedulers: P's signed offers over finished prefills, D's
    validation of them and the READ (`RecvTask`) each accepted offer ends in."""

    def __init__(self, engine_id: str, host: str, port: int, block_size: int, tp_size: int,
                 num_kv_heads: int, clock: Callable[[], float], offer_ttl: float) -> None:
        """``offer_ttl`` (P): offers expire this long after the prefill (0: never)."""
        self.engine_id, self.host, self.port = engine_id, host, port
        self.block_size, self.tp_size, self.num_kv_heads = block_size, tp_size, num_kv_heads
        self.clock = clock
        self.offer_ttl = offer_ttl
        self._offers: dict[str, _Pending] = {}  # D: accepted, not yet allocated
        self.rejected: dict[str, InvalidParams] = {}  # D: req id -> why its offer was refused

    # -- D ----------------------------------------------------------------------------------
    def matched(self, req_id: str, prompt: Sequence[int], params: Mapping[str, Any],
                num_computed: int) -> tuple[int, bool]:
        """Tokens D will load from P (async) beyond its own prefix-cache hit."""
        pend = self._offers.get(req_id)
        if pend is None:
            if req_id in self.rejected:
                return 0, False
            try:
                offer = self.validate(prompt, params)
            except InvalidParams as e:
                self.rejected[req_id] = e
                log.warning("request %s: recomputing locally, offer rejected: %s", req_id, e)
                return 0, False
            pend = self._offers[req_id] = _Pending(offer, num_computed, len(prompt))
        pend.local_hit_tokens = num_computed
        count = pend.num_tokens - num_computed
        return (count, True) if count > 0 else (0, False)

    def validate(self, prompt: Sequence[int], params: Mapping[str, Any]) -> RemotePrefill:
        """P's offer for exactly this prompt, readable by our ranks; else InvalidParams."""
        offer = parse_offer(params)
        if offer.remote_num_tokens != len(prompt) or offer.prompt_hash != prompt_hash(prompt):
            raise InvalidParams("offer is for a different prompt (token mismatch)",
                                "prompt_mismatch")
        if blocks_needed(len(prompt), self.block_size) > len(offer.remote_block_ids):
            raise InvalidParams(
                f"offer has {len(offer.remote_block_ids)} blocks for {len(prompt)} tokens",
                "too_few_blocks")
        check_split(self.num_kv_heads, offer.remote_tp_size, self.tp_size, "prefill", "decode")
        return offer

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external: int,
                  meta: StepMeta) -> None:
        """Blocks exist for the request: queue the READ (or a release if nothing to read)."""
        pend = self._offers.pop(req_id, None)
        if pend is None:
            return
        hit = pend.local_hit_tokens // self.block_size
        need = blocks_needed(pend.num_tokens, self.block_size)
        if num_external <= 0 or hit >= need:
            meta.recv.append(RecvTask(req_id, [], [], pend.offer, release_only=True))
            return
        local = list(block_ids[hit:need])
        remote = list(pend.offer.remote_block_ids[hit:need])
        if len(local) != len(remote):
            log.warning("request %s: %d local blocks for %d remote; recomputing", req_id,
                        len(local), len(remote))
            meta.recv.append(RecvTask(req_id, [], [], pend.offer, release_only=True))
            return
        meta.recv.append(RecvTask(req_id, local, remote, pend.offer))

    def forget(self, req_id: str, meta: StepMeta) -> None:
        """The request ended. Before its blocks were allocated: P may free its own now. A
        D request aborted mid-READ needs nothing here: vLLM keeps its blocks until the
        worker reports the READ finished (done or failed)."""
        self.rejected.pop(req_id, None)
        pend = self._offers.pop(req_id, None)
        if pend is not None:
            meta.recv.append(RecvTask(req_id, [], [], pend.offer, release_only=True))

    # -- P ----------------------------------------------------------------------------------
    def publish(self, req_id: str, kp: KvParams, block_ids: Sequence[int], prompt: Sequence[int],
                meta: StepMeta) -> dict[str, Any]:
        """A finished prefill: keep its blocks for D (until D's READ or the send timeout)
        and return the signed offer."""
        offer = RemotePrefill(
            remote_engine_id=self.engine_id, remote_host=self.host, remote_port=self.port,
            remote_block_ids=list(block_ids), remote_request_id=req_id,
            remote_num_tokens=len(prompt), prompt_hash=prompt_hash(prompt),
            remote_tp_size=self.tp_size, transfer_id=kp.transfer_id,
            expiry=self.clock() + self.offer_ttl if self.offer_ttl > 0 else 0.0,
        )
        meta.send.append(req_id)
        return sign(offer)
