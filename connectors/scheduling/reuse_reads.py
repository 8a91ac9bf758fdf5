"""Bidirectional reuse, P's scheduler side: READ D's leased history before computing the rest.

On a later turn the router relays D's signed lease offer in P's params (``reuse``). P
verifies it, decides how much to read (`protocol.reuse.decide_reuse`: only past its own
prefix hit, only hash-matching full blocks, only from a lease that outlives the READ),
queues a `ReuseRead` once blocks exist, and reports what happened (`ReuseReport`) in its
returned params. Any failure is a recompute, never a wrong answer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvferry.connectors.config import default_control_port
from kvferry.connectors.protocol.params import (
    InvalidParams,
    KvParams,
    LeaseOffer,
    ReuseReport,
    parse_lease,
)
from kvferry.connectors.protocol.reuse import (
    DEFAULT_LEASE_MARGIN,
    DEFAULT_READ_TIMEOUT,
    DEFAULT_RECOMPUTE_THRESHOLD,
    Decision,
    RemoteOffer,
    decide_reuse,
)
from kvferry.connectors.protocol.step import ReuseRead, StepMeta
from kvferry.connectors.scheduling.pull import check_split

log = logging.getLogger("vllm." + __name__)  # under vLLM's handlers


@dataclass
class ReuseSettings:
    """When P reads D's leased history rather than recomputing it (config.py: the
    kv_recompute_threshold, lease_margin_s and reuse_read_timeout_s settings)."""

    threshold: int = DEFAULT_RECOMPUTE_THRESHOLD
    margin_s: float = DEFAULT_LEASE_MARGIN
    read_timeout_s: float = DEFAULT_READ_TIMEOUT


class ReusePlanner:
    """P's scheduler: verifies D's lease offer, decides how much history to READ and
    queues the `ReuseRead` once blocks exist; reports what happened in P's params."""

    def __init__(self, block_size: int, tp_size: int, num_kv_heads: int,
                 settings: ReuseSettings, clock: Callable[[], float]) -> None:
        self.block_size, self.tp_size, self.num_kv_heads = block_size, tp_size, num_kv_heads
        self.settings = settings
        self.clock = clock
        self._decided: dict[str, tuple[LeaseOffer, Decision]] = {}  # before allocation
        self._reading: dict[str, tuple[int, set[int]]] = {}  # READs in flight
        self._report: dict[str, ReuseReport] = {}  # what reuse did, per request

    def matched(self, req_id: str, prompt: Sequence[int], kp: KvParams,
                num_computed: int) -> tuple[int, bool]:
        """Tokens of D's leased history P will READ (async) beyond its own prefix hit."""
        self._decided.pop(req_id, None)
        try:
            offer = parse_lease(kp.reuse)
            check_split(self.num_kv_heads, offer.tp_size, self.tp_size, "decode", "prefill")
            if offer.block_size != self.block_size:
                raise InvalidParams(f"decode block size {offer.block_size} != {self.block_size}",
                                    "block_size_mismatch")
        except InvalidParams as e:
            log.warning("request %s: not reusing decode's KV: %s", req_id, e)
            self._report[req_id] = ReuseReport(0, "invalid_offer")
            return 0, False
        remote = RemoteOffer(offer.lease_id, offer.num_tokens, offer.block_ids,
                             offer.block_hashes, offer.block_size, offer.expiry, offer.engine_id)
        rs = self.settings
        dec = decide_reuse(prompt, num_computed, remote, self.clock(), block_size=self.block_size,
                           recompute_threshold=rs.threshold, lease_margin=rs.margin_s)
        self._report[req_id] = ReuseReport(0, dec.reason)
        if not dec.read:
            return 0, False
        self._decided[req_id] = (offer, dec)
        return dec.tokens_to_read, True

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external: int,
                  meta: StepMeta) -> bool:
        """Blocks exist: queue the READ (False: no reuse was decided for this request)."""
        if req_id not in self._decided:
            return False
        offer, dec = self._decided.pop(req_id)
        lo, hi = dec.local_block_range
        local = list(block_ids[lo:hi])
        if num_external <= 0 or len(local) != len(dec.remote_block_ids):
            self._report[req_id] = ReuseReport(0, "not_allocated")
            return True
        meta.reuse.append(ReuseRead(
            req_id, local, list(dec.remote_block_ids), offer.engine_id, offer.instance,
            offer.host, offer.port, self.clock() + self.settings.read_timeout_s,
            offer.tp_size, offer.lease_id,
            offer.control_port or default_control_port(offer.port, offer.tp_size)))
        self._reading[req_id] = (dec.tokens_to_read, set(local))
        return True

    def received(self, req_ids: Iterable[str], invalid_blocks: set[int]) -> None:
        """READs the workers reported ended; ``invalid_blocks`` failed to load."""
        for req_id in req_ids:
            reading = self._reading.pop(req_id, None)
            if reading is not None and req_id in self._report:
                n, local = reading
                ok = not (local & invalid_blocks)
                self._report[req_id] = ReuseReport(n if ok else 0, "ok" if ok else "read_failed")

    def forget(self, req_id: str) -> ReuseReport | None:
        """The request ended: what its reuse did (None: no offer was considered)."""
        self._decided.pop(req_id, None)
        self._reading.pop(req_id, None)
        return self._report.pop(req_id, None)
