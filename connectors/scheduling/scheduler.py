"""Scheduler-side transfer state of one engine: the facade vLLM's glue calls.

Plain state with no vLLM imports and no I/O, so it is unit-testable: the vLLM glue
(`connector.py`) turns scheduler callbacks into calls here and ships `StepMeta` to the
workers each step. Each mode has its own planner, and a request's kv_transfer_params
(`KvParams`) pick the one that decides: pull (`pull.py`), push and early push
(`push.py`, `early_push.py`), P's reuse of D's leased KV (`reuse_reads.py`), D's leases
(`lease_keeper.py`) and P's host-staged saves (`staged_saves.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from kvferry.connectors.protocol.params import InvalidParams, KvParams, kv_params, lease_answer
from kvferry.connectors.protocol.step import StepMeta
from kvferry.connectors.scheduling.early_push import EarlyPush
from kvferry.connectors.scheduling.lease_keeper import LeaseKeeper
from kvferry.connectors.scheduling.pull import PullPlanner
from kvferry.connectors.scheduling.push import PushPlanner
from kvferry.connectors.scheduling.reuse_reads import ReusePlanner, ReuseSettings
from kvferry.connectors.scheduling.staged_saves import SaveTracker

__all__ = ["ReuseSettings", "StepMeta", "TransferScheduler"]

log = logging.getLogger("vllm." + __name__)  # under vLLM's handlers

Finished = tuple[bool, dict[str, Any] | None]  # (keep the blocks, params to return)


class TransferScheduler:
    """Scheduler-side state of one engine, for pull and push (P and D roles alike)."""

    def __init__(self, engine_id: str, host: str, port: int, block_size: int, tp_size: int = 1,
                 leases: LeaseKeeper | None = None, reuse: ReuseSettings | None = None,
                 clock: Callable[[], float] = time.time, stage_saves: bool = False,
                 offer_ttl: float = 0.0, early_push: bool = False, num_kv_heads: int = 0):
        """``clock``: wall clock (offers, reuse deadlines and push marks cross processes);
        ``num_kv_heads``: the model's, over all ranks (0: unknown, so no TP split)."""
        self.engine_id = engine_id
        self.block_size = block_size
        self.tp_size = tp_size
        self.clock = clock
        self.leases = leases  # D: LeaseKeeper (bidirectional reuse), or None
        self.pull = PullPlanner(engine_id, host, port, block_size, tp_size, num_kv_heads, clock,
                                offer_ttl)
        self.push = PushPlanner(block_size, clock)
        self.early = EarlyPush(block_size, early_push)
        self.reuse = ReusePlanner(block_size, tp_size, num_kv_heads, reuse or ReuseSettings(),
                                  clock)
        # P: pull requests' blocks to stage out, when the workers may stage through host DRAM
        self.saves = SaveTracker(block_size) if stage_saves else None
        self.waiting_send: set[str] = set()  # P: delayed-free requests not yet reported
        self._meta = StepMeta()

    @staticmethod
    def _params(params: Any) -> KvParams:
        """The request's kvferry keys; malformed ones (`matched_tokens` recorded why, it
        sees every request first) mean nothing to transfer: the request computes here."""
        try:
            return kv_params(params)
        except InvalidParams:
            return KvParams()

    @property
    def early_push(self) -> bool:
        return self.early.enabled

    @property
    def pushed_early(self) -> dict[str, str]:
        """P: request id -> transfer id of prefills whose WRITE was handed over early."""
        return self.early.pushed

    @property
    def landed(self) -> dict[str, str]:
        """D, timeline only: push requests whose KV is in, first step not yet planned."""
        return self.push.landed

    # -- P side: early push ------------------------------------------------------------
    def track_push_prefill(self, req_id: str, prompt: Sequence[int],
                           params: Mapping[str, Any] | None, max_tokens: int | None) -> None:
        """Follow a push prefill whose forward may start its WRITE (early push)."""
        if self.early.enabled:
            self.early.track(req_id, prompt, self._params(params), max_tokens)

    def plan_push(self, progress: Mapping[str, tuple[int, int]],
                  grown: Mapping[str, tuple[Sequence[int], bool]],
                  preempted: set[str]) -> None:
        """This step's scheduler output -> `StepMeta.push_ready` / `push_preempted`."""
        self.early.plan(progress, grown, preempted, self.clock(), self._meta)

    def tracks_push(self) -> bool:
        return self.early.tracks()

    # -- matching and allocation ---------------------------------------------------------
    def matched_tokens(self, req_id: str, prompt: Sequence[int], params: Mapping[str, Any] | None,
                       num_computed: int) -> tuple[int, bool]:
        """Tokens this engine will load (async) beyond its own prefix-cache hit: D from P
        (pull or push), P from D's leased history (reuse)."""
        try:
            kp = kv_params(params)
        except InvalidParams as e:
            self.pull.rejected[req_id] = e
            log.warning("request %s: recomputing locally: %s", req_id, e)
            return 0, False
        if kp.reuse is not None and not kp.do_remote_prefill:
            return self.reuse.matched(req_id, prompt, kp, num_computed)
        if not kp.do_remote_prefill:
            return 0, False
        if kp.push:
            return self.push.matched(req_id, prompt, kp, num_computed)
        return self.pull.matched(req_id, prompt, params or {}, num_computed)

    def after_alloc(self, req_id: str, block_ids: Sequence[int], num_external: int,
                    params: Mapping[str, Any] | None = None) -> None:
        """Blocks exist for the request: queue the READ (or a release if nothing to read).

        ``params`` (the request's kv_transfer_params) marks P-role pull requests, whose
        blocks host staging must copy to the mirror as the forward fills them."""
        self.early.allocated(req_id, block_ids)
        if self.saves is not None and params:
            kp = self._params(params)
            if kp.do_remote_decode and not kp.push:  # push: P stages right before its WRITE
                self.saves.allocated(req_id, block_ids)
        if (self.reuse.allocated(req_id, block_ids, num_external, self._meta)
                or self.push.allocated(req_id, block_ids, num_external, self._meta)):
            return
        self.pull.allocated(req_id, block_ids, num_external, self._meta)

    def rejection(self, req_id: str) -> str | None:
        """Why D refused to load this request's KV (it recomputes), or None."""
        why = self._rejected(req_id)
        return None if why is None else str(why)

    def rejection_code(self, req_id: str) -> str | None:
        """That refusal's reason code (InvalidParams.REASONS), or None."""
        why = self._rejected(req_id)
        return None if why is None else why.code

    def _rejected(self, req_id: str) -> InvalidParams | None:
        return self.pull.rejected.get(req_id) or self.push.rejected.get(req_id)

    # -- the end of a request --------------------------------------------------------------
    def finished(self, req_id: str, ok: bool, block_ids: Sequence[int], params: Mapping[str, Any] | None,
                 prompt: Sequence[int], tokens: Sequence[int] = (),
                 num_computed: int = 0) -> Finished:
        """P: keep a finished prefill's blocks for D and publish the signed offer.
        D: keep a finished turn's blocks under a lease when the router asked for one."""
        meta = self._meta
        self.pull.forget(req_id, meta)
        self.push.forget(req_id, meta)
        early = self.early.forget(req_id)
        report = self.reuse.forget(req_id)
        if self.saves is not None:  # staged by the step that computed the prompt (or never)
            self.saves.drop([req_id])
        kp = self._params(params)
        if kp.lease is not None and not kp.do_remote_decode:
            return self._lease(req_id, ok, block_ids, kp, tokens, num_computed)
        if not kp.do_remote_decode:
            return False, None
        extra = msgspec.to_builtins(report) if report is not None else {}
        if kp.push:
            out = self.push.finished(req_id, ok, block_ids, kp, prompt, early, meta)
            keep, returned = out.keep, out.params and {**out.params, **extra}
        elif ok and block_ids:
            keep, returned = True, {**self.pull.publish(req_id, kp, block_ids, prompt, meta), **extra}
        else:
            keep, returned = False, None
        if keep:
            self.waiting_send.add(req_id)
        return keep, returned

    def _lease(self, req_id: str, ok: bool, block_ids: Sequence[int], kp: KvParams,
               tokens: Sequence[int], num_computed: int) -> Finished:
        """D: keep a finished turn's blocks under the lease the router asked for."""
        if ok and block_ids and self.leases is not None:
            lease = self.leases.grant(req_id, kp.lease, block_ids, tokens, num_computed)
            if lease is not None:
                return True, lease_answer(lease)
        return False, None

    def worker_done(self, sent: set[str], recvd: set[str] = frozenset(),
                    invalid_blocks: set[int] = frozenset()) -> None:
        """Workers reported finished sends (P's blocks free) and receives (D, or P's reuse
        READs; ``invalid_blocks`` are blocks whose load failed)."""
        self.waiting_send -= sent
        self.push.received(recvd)
        self.reuse.received(recvd, invalid_blocks)

    def note_scheduled(self, req_ids: Iterable[str]) -> None:
        """Timeline only: push requests whose first decode step was just scheduled."""
        self.push.note_scheduled(req_ids)

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
