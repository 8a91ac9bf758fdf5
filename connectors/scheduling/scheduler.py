"""Scheduler-side pull logic: which requests read, which blocks P keeps, and for how long.

Plain state with no vLLM imports and no I/O, so it is unit-testable: the vLLM glue
(`connector.py`) turns scheduler callbacks into calls here and ships `StepMeta` to the
workers each step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvferry.connectors.protocol import timeline
from kvferry.connectors.protocol.params import (
    InvalidParams,
    LeaseOffer,
    RemotePrefill,
    blocks_needed,
    parse_lease,
    parse_offer,
    prompt_hash,
    sign,
)
from kvferry.connectors.protocol.reuse import Decision, RemoteOffer, decide_reuse
from kvferry.connectors.protocol.step import PushSend, RecvTask, RegisterTask, ReuseRead, StepMeta
from kvferry.connectors.protocol.tp_map import plan
from kvferry.connectors.scheduling.staged_saves import SaveTracker

log = logging.getLogger("vllm." + __name__)  # under vLLM's handlers

MAX_TP = 64  # bound on a peer's TP size (it sizes per-rank plans)


@dataclass
class ReuseSettings:
    threshold: int = 64  # kv_recompute_threshold
    margin_s: float = 2.0
    read_timeout_s: float = 1.5


@dataclass
class _PushPending:
    transfer_id: str
    host: str
    port: int
    local_hit_tokens: int
    num_tokens: int
    prompt_hash: str


@dataclass
class _PushPrefill:
    """P, early push: a single-token push prefill being computed, and its blocks so far."""

    transfer_id: str
    num_tokens: int
    prompt_hash: str
    blocks: list[int] = field(default_factory=list)


@dataclass
class _Pending:
    offer: RemotePrefill
    local_hit_tokens: int
    num_tokens: int


class TransferScheduler:
    """Scheduler-side state of one engine, for pull and push (P and D roles alike)."""

    def __init__(self, engine_id: str, host: str, port: int, block_size: int, tp_size: int = 1,
                 leases: Any = None, reuse: ReuseSettings | None = None, clock: Any = time.time,
                 stage_saves: bool = False, offer_ttl: float = 0.0, early_push: bool = False,
                 num_kv_heads: int = 0):
        self.engine_id = engine_id
        self.num_kv_heads = num_kv_heads  # the model's, over all ranks (0: unknown)
        self.host = host
        self.port = port
        self.block_size = block_size
        self.tp_size = tp_size
        self._offers: dict[str, _Pending] = {}
        self._rejected: dict[str, str] = {}
        self._meta = StepMeta()
        self._push: dict[str, _PushPending] = {}  # D: push requests before allocation
        self.push_waiting: dict[str, str] = {}  # D: req id -> transfer id awaiting P's WRITE
        self.landed: dict[str, str] = {}  # D, timeline only: KV in, first step not yet planned
        self.waiting_send: set[str] = set()  # P: delayed-free requests not yet reported
        self.leases = leases  # D: LeaseKeeper (bidirectional reuse), or None
        self.reuse_settings = reuse or ReuseSettings()
        self.clock = clock
        self.offer_ttl = offer_ttl  # P: pull offers expire this long after the prefill
        self._reuse: dict[str, tuple[LeaseOffer, Decision]] = {}  # P: before allocation
        self._reading: dict[str, tuple[int, set[int]]] = {}  # P: reuse READs in flight
        self._reuse_out: dict[str, dict[str, Any]] = {}  # P: what reuse did, per request
        # P: pull requests' blocks to stage out, when the workers may stage through host DRAM
        self.saves = SaveTracker(block_size) if stage_saves else None
        # P, early push: prefills tracked until their last chunk is scheduled; then the
        # transfer ids handed to the workers, until vLLM finishes (or preempts) the request
        self.early_push = early_push
        self._push_p: dict[str, _PushPrefill] = {}
        self.pushed_early: dict[str, str] = {}
        self._no_early: set[str] = set()  # preempted after an early push: the normal path

    # -- P side: early push ------------------------------------------------------------
    def track_push_prefill(self, req_id: str, prompt: Sequence[int],
                           params: Mapping[str, Any] | None, max_tokens: int | None) -> None:
        """Follow a push prefill whose forward may start its WRITE (early push).

        Only single-token requests (the router's P leg): vLLM finishes them in the step
        that computes the prompt, so their blocks stay put from that forward until the
        request ends, except for a preemption while that step's output is pending, which
        the next step's meta reports before any WRITE starts."""
        if (not self.early_push or max_tokens != 1 or not params
                or not params.get("do_remote_decode") or not params.get("push")
                or req_id in self._push_p or req_id in self.pushed_early
                or req_id in self._no_early):
            return
        tid = params.get("transfer_id")
        if isinstance(tid, str) and tid:
            self._push_p[req_id] = _PushPrefill(tid, len(prompt), prompt_hash(prompt))

    def plan_push(self, progress: Mapping[str, tuple[int, int]],
                  grown: Mapping[str, tuple[Sequence[int], bool]],
                  preempted: set[str]) -> None:
        """This step's scheduler output -> `StepMeta.push_ready` / `push_preempted`."""
        for req_id in preempted:
            if req_id in self._push_p or req_id in self.pushed_early:
                self._no_early.add(req_id)  # resumed, it pushes when it finishes
            self._push_p.pop(req_id, None)
            if (tid := self.pushed_early.pop(req_id, None)) is not None:
                self._meta.push_preempted.append((tid, req_id))
        for req_id, (ids, replace) in grown.items():
            if (pp := self._push_p.get(req_id)) is not None:
                pp.blocks = list(ids) if replace else pp.blocks + list(ids)
        now = time.time()
        for req_id, (computed, n) in progress.items():
            pp = self._push_p.get(req_id)
            if pp is None or n <= 0 or computed + n < pp.num_tokens:
                continue
            del self._push_p[req_id]
            if len(pp.blocks) < blocks_needed(pp.num_tokens, self.block_size):
                log.warning("request %s: %d blocks known for %d tokens; pushing when it ends",
                            req_id, len(pp.blocks), pp.num_tokens)
                continue
            self.pushed_early[req_id] = pp.transfer_id
            timeline.mark(log, pp.transfer_id, "last_chunk_scheduled", now)
            self._meta.push_ready.append(PushSend(req_id, pp.transfer_id, list(pp.blocks),
                                                  pp.num_tokens, pp.prompt_hash, now))

    def tracks_push(self) -> bool:
        return bool(self._push_p or self.pushed_early)

    # -- P side: bidirectional reuse ----------------------------------------------------
    def _reuse_matched(self, req_id: str, prompt: Sequence[int], params: Mapping[str, Any],
                       num_computed: int) -> tuple[int, bool]:
        """Tokens of D's leased history P will READ (async) beyond its own prefix hit."""
        self._reuse.pop(req_id, None)
        try:
            offer = parse_lease(params["reuse"])
            if offer.tp_size != self.tp_size:
                self._check_split(offer.tp_size, self.tp_size, "decode", "prefill")
            if offer.block_size != self.block_size:
                raise InvalidParams(f"decode block size {offer.block_size} != {self.block_size}")
        except InvalidParams as e:
            log.warning("request %s: not reusing decode's KV: %s", req_id, e)
            self._reuse_out[req_id] = {"reused_tokens": 0, "reuse_reason": "invalid_offer"}
            return 0, False
        remote = RemoteOffer(offer.lease_id, offer.num_tokens, offer.block_ids,
                             offer.block_hashes, offer.block_size, offer.expiry, offer.engine_id)
        rs = self.reuse_settings
        dec = decide_reuse(prompt, num_computed, remote, self.clock(), block_size=self.block_size,
                           recompute_threshold=rs.threshold, lease_margin=rs.margin_s)
        self._reuse_out[req_id] = {"reused_tokens": 0, "reuse_reason": dec.reason}
        if not dec.read:
            return 0, False
        self._reuse[req_id] = (offer, dec)
        return dec.tokens_to_read, True

    def _reuse_alloc(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        offer, dec = self._reuse.pop(req_id)
        lo, hi = dec.local_block_range
        local = list(block_ids[lo:hi])
        if num_external <= 0 or len(local) != len(dec.remote_block_ids):
            self._reuse_out[req_id] = {"reused_tokens": 0, "reuse_reason": "not_allocated"}
            return
        self._meta.reuse.append(ReuseRead(
            req_id, local, list(dec.remote_block_ids), offer.engine_id, offer.instance,
            offer.host, offer.port, self.clock() + self.reuse_settings.read_timeout_s,
            offer.tp_size))
        self._reading[req_id] = (dec.tokens_to_read, set(local))

    # -- D side ------------------------------------------------------------------------
    def matched_tokens(self, req_id: str, prompt: Sequence[int], params: Mapping[str, Any] | None,
                       num_computed: int) -> tuple[int, bool]:
        """Tokens D will load from P (async) beyond its own prefix-cache hit."""
        if params and params.get("reuse") is not None and not params.get("do_remote_prefill"):
            return self._reuse_matched(req_id, prompt, params, num_computed)
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
            self._check_split(offer.remote_tp_size, self.tp_size, "prefill", "decode")
        return offer

    def _check_split(self, src_tp: int, dst_tp: int, src: str, dst: str) -> None:
        """Each rank here will read its heads from the peer ranks holding them
        (tp_map.plan): refuse when the model's heads do not split over both sizes."""
        if self.num_kv_heads <= 0 or src_tp > MAX_TP:
            raise InvalidParams(f"{src} TP {src_tp} != {dst} TP {dst_tp} "
                                "(KV heads unknown or TP too large)")
        try:
            plan(self.num_kv_heads, src_tp, dst_tp, 0)
        except ValueError as e:
            raise InvalidParams(f"{src} TP {src_tp} -> {dst} TP {dst_tp}: {e}") from None

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

    def after_alloc(self, req_id: str, block_ids: Sequence[int], num_external: int,
                    params: Mapping[str, Any] | None = None) -> None:
        """Blocks exist for the request: queue the READ (or a release if nothing to read).

        ``params`` (the request's kv_transfer_params) marks P-role pull requests, whose
        blocks host staging must copy to the mirror as the forward fills them."""
        if (pp := self._push_p.get(req_id)) is not None:
            pp.blocks = list(block_ids)
        if (self.saves is not None and params and params.get("do_remote_decode")
                and not params.get("push")):  # push: P stages right before its WRITE
            self.saves.allocated(req_id, block_ids)
        if req_id in self._reuse:
            self._reuse_alloc(req_id, block_ids, num_external)
            return
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
                 prompt: Sequence[int], transfer_id: str = "", tokens: Sequence[int] = (),
                 num_computed: int = 0) -> tuple[bool, dict[str, Any] | None]:
        """P: keep a finished prefill's blocks for D and publish the signed offer.
        D: keep a finished turn's blocks under a lease when the router asked for one."""
        self._rejected.pop(req_id, None)
        self.landed.pop(req_id, None)
        self._push_p.pop(req_id, None)
        self._no_early.discard(req_id)
        early = self.pushed_early.pop(req_id, None) is not None
        self._reuse.pop(req_id, None)
        self._reading.pop(req_id, None)
        if self.saves is not None:  # staged by the step that computed the prompt (or never)
            self.saves.drop([req_id])
        reuse_out = self._reuse_out.pop(req_id, {})
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
        if params and params.get("lease") is not None and not params.get("do_remote_decode"):
            if ok and block_ids and self.leases is not None:
                lease = self.leases.grant(req_id, params["lease"], block_ids, tokens, num_computed)
                if lease is not None:
                    return True, {"lease": lease}
            return False, None
        if not params or not params.get("do_remote_decode"):
            return False, None
        if params.get("push"):
            tid = str(params.get("transfer_id", ""))
            if not ok or not block_ids or not tid:
                if tid:
                    self._meta.push_abort_p.append((tid, req_id))
                if early and tid:  # a WRITE may be reading the blocks: the worker frees
                    self.waiting_send.add(req_id)
                    return True, None
                return False, None
            ended = time.time()
            timeline.mark(log, tid, "prefill_end", ended)
            self._meta.push_send.append(PushSend(req_id, tid, list(block_ids), len(prompt),
                                                 prompt_hash(prompt), ended))
            self.waiting_send.add(req_id)
            return True, {"transfer_id": tid, "push": True, **reuse_out}
        if not ok or not block_ids:
            return False, None
        offer = RemotePrefill(
            remote_engine_id=self.engine_id, remote_host=self.host, remote_port=self.port,
            remote_block_ids=list(block_ids), remote_request_id=req_id,
            remote_num_tokens=len(prompt), prompt_hash=prompt_hash(prompt),
            remote_tp_size=self.tp_size, transfer_id=str(params.get("transfer_id", "")),
            expiry=self.clock() + self.offer_ttl if self.offer_ttl > 0 else 0.0,
        )
        self._meta.send.append(req_id)
        self.waiting_send.add(req_id)
        return True, {**sign(offer), **reuse_out}

    def worker_done(self, sent: set[str], recvd: set[str] = frozenset(),
                    invalid_blocks: set[int] = frozenset()) -> None:
        """Workers reported finished sends (P's blocks free) and receives (D, or P's reuse
        READs; ``invalid_blocks`` are blocks whose load failed)."""
        self.waiting_send -= sent
        for req_id in recvd:
            if (tid := self.push_waiting.pop(req_id, None)) is not None and timeline.ENABLED:
                timeline.mark(log, tid, "kv_seen")
                self.landed[req_id] = tid
            reading = self._reading.pop(req_id, None)
            if reading is not None and req_id in self._reuse_out:
                n, local = reading
                ok = not (local & invalid_blocks)
                self._reuse_out[req_id] = {"reused_tokens": n if ok else 0,
                                           "reuse_reason": "ok" if ok else "read_failed"}

    def note_scheduled(self, req_ids: Iterable[str]) -> None:
        """Timeline only: push requests whose first decode step was just scheduled."""
        for req_id in req_ids:
            if (tid := self.landed.pop(req_id, None)) is not None:
                timeline.mark(log, tid, "scheduled")

    def plan_saves(self, progress: Mapping[str, tuple[int, int]],
                   grown: Mapping[str, tuple[Sequence[int], bool]] | None = None) -> None:
        """Host staging, P: this step's (computed, scheduled) tokens per request and blocks
        added to running requests -> `StepMeta.save`. No-op unless staging may be active."""
        if self.saves is None:
            return
        if grown:
            self.saves.grew(grown)
        self._meta.save += self.saves.step(progress)

    def take_meta(self) -> StepMeta:
        meta, self._meta = self._meta, StepMeta()
        if self.leases is not None:
            meta.free = self.leases.due_frees()
        return meta
