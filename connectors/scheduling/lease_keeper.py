"""D keeps finished turns' KV blocks under leases, so P can READ them on the next turn.

The scheduler side of one decode engine owns a `LeaseKeeper`. When a request that the
router marked ``{"lease": {"lease_id": ..., "ttl": ...}}`` finishes, vLLM keeps its blocks
(delayed free) and the keeper grants a lease over the full blocks holding computed KV,
returning a signed `LeaseOffer` (with the prefix hash chain) that vLLM hands back in the
response's ``kv_transfer_params``. Renew/release/info arrive from the router over the
lease-control side channel (another thread, hence the lock).

Safety against freeing blocks under a running READ is time-based, because READs are
one-sided and D never sees them. D may end a lease at any time (expiry, release, memory
pressure in `relieve`, the lease cap) while the router still holds its offer, so P asks
D that the lease still holds just before each READ (`transfer.lease_control.LeaseCheck`)
and abandons the READ after ``read_timeout`` (< ``free_grace``). A "held" answer at t (D's
clock) therefore means: no free before t + free_grace, when that READ has ended. A lease
that ends with no "held" answer in the last ``free_grace`` seconds has no READ in flight
and its blocks are freed at once: under memory pressure that is the difference between a
waiting request starting now and ``free_grace`` later.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvferry.connectors.protocol.lease import (
    DEFAULT_FREE_GRACE,
    DEFAULT_MAX_LIFETIME,
    DEFAULT_TTL,
    FreeBlocks,
    LeaseError,
    LeaseTable,
    Refusal,
)
from kvferry.connectors.protocol.params import InvalidParams, LeaseOffer, lease_request, sign
from kvferry.connectors.protocol.prefix import block_hashes

log = logging.getLogger("vllm." + __name__)

TICK_S = 0.05  # sweep leases at most this often (the idle engine steps every ~1 ms)


class LeaseKeeper:
    """D's scheduler: grants, renews and ends the leases over finished turns' blocks and
    frees their blocks no sooner than a READ that P may have started can have ended."""

    def __init__(self, engine_id: str, instance: str, host: str, port: int, block_size: int,
                 tp_size: int = 1, *, ttl: float = DEFAULT_TTL, max_lifetime: float = DEFAULT_MAX_LIFETIME,
                 max_blocks: int | None = None, free_grace: float = DEFAULT_FREE_GRACE,
                 clock: Callable[[], float] = time.time, control_port: int = 0) -> None:
        self.engine_id, self.instance = engine_id, instance
        self.host, self.port, self.control_port = host, port, control_port
        self.block_size, self.tp_size = block_size, tp_size
        self.free_grace = free_grace
        self.clock = clock
        self.table = LeaseTable(ttl, max_lifetime=max_lifetime, max_blocks=max_blocks)
        self._offers: dict[str, LeaseOffer] = {}
        self._frees: list[tuple[float, str, int]] = []  # (free at, req id, blocks)
        self._held_at: dict[str, float] = {}  # lease id -> D's last "held" answer to P
        self.released_for_pressure = 0  # leases ended early because D needed the memory
        self._last_tick = float("-inf")
        self._lock = threading.Lock()

    # -- scheduler thread ------------------------------------------------------------------
    def grant(self, req_id: str, request: Any, block_ids: Sequence[int], token_ids: Sequence[int],
              num_computed: int) -> dict[str, Any] | None:
        """Lease a finished request's blocks; the signed offer, or None (free them now)."""
        try:
            asked = lease_request(request)
        except InvalidParams as e:
            log.warning("request %s: %s; not keeping its KV", req_id, e)
            return None
        lease_id, ttl = asked.lease_id, asked.ttl
        n_kv = max(0, min(num_computed, len(token_ids)))
        full = min(n_kv // self.block_size, len(block_ids))
        if full == 0:
            return None
        tokens = list(token_ids[: full * self.block_size])
        hashes = block_hashes(tokens, self.block_size)
        now = self.clock()
        with self._lock:
            try:
                expiry, evicted = self.table.grant(lease_id, req_id, block_ids[:full],
                                                   len(tokens), hashes, now, ttl=ttl)
            except LeaseError as e:
                log.warning("request %s: no lease (%s); freeing its KV", req_id, e)
                return None
            self._schedule(evicted, now)
            offer = LeaseOffer(self.engine_id, self.instance, self.host, self.port, lease_id,
                               list(block_ids[:full]), self.block_size, len(tokens), hashes,
                               expiry, self.tp_size, self.control_port)
            self._offers[lease_id] = offer
        log.info("lease %s: %d blocks (%d tokens) of request %s until +%.0fs", lease_id, full,
                 len(tokens), req_id, expiry - now)
        return sign(offer)

    def due_frees(self) -> list[str]:
        """Request ids whose blocks may be freed now (leases ended at least a grace ago)."""
        now = self.clock()
        with self._lock:
            if now - self._last_tick >= TICK_S:
                self._last_tick = now
                self._schedule(self.table.tick(now), now)
            if not self._frees:
                return []
            due = [r for at, r, _ in self._frees if at <= now]
            self._frees = [f for f in self._frees if f[0] > now]
            return due

    def evict_for_pressure(self) -> bool:
        """vLLM could not allocate (`has_pending_block_frees`): release the least recently
        used lease, unless blocks are already due to come free. True if a free is coming."""
        with self._lock:
            self._release_lru(lambda due: due == 0, self.clock())
            return bool(self._frees)

    def relieve(self, free: int, total: int, head_need: int, watermark: float) -> list[str]:
        """Memory is getting short: release least recently used leases until the free
        blocks plus those due to come free now cover ``max(watermark * total, head_need)``
        (the reserve running requests grow into, and what the first waiting request
        needs). Blocks kept a grace for a READ in flight do not count: the request would
        wait for them. Any vLLM version, every step; the lease ids released."""
        want = max(math.ceil(watermark * total), head_need)
        if free >= want:
            return []
        with self._lock:
            released = self._release_lru(lambda coming: free + coming < want, self.clock())
        if released:
            log.info("leases %s: released early, %d of %d KV blocks free and %d wanted",
                     released, free, total, want)
        return released

    @property
    def num_blocks(self) -> int:
        return self.table.num_blocks

    # -- control thread (router) ----------------------------------------------------------
    def renew(self, lease_id: str, ttl: float | None = None) -> dict[str, Any]:
        now = self.clock()
        ttl = None if ttl is None else min(ttl, self.table.ttl)  # never beyond D's own TTL
        with self._lock:
            expiry = self.table.renew(lease_id, now, ttl)
            offer = self._offers[lease_id]
            offer.expiry = expiry
            return sign(offer)

    def release(self, lease_id: str) -> None:
        now = self.clock()
        with self._lock:
            self._schedule(self.table.release(lease_id, now), now)

    def info(self, lease_id: str, for_read: bool = False) -> dict[str, Any]:
        """The signed offer of a lease that still holds, else LeaseError. ``for_read``: a P
        asks before READing the blocks (`LeaseCheck`), so they outlive that READ."""
        now = self.clock()
        with self._lock:
            lease = self.table.get(lease_id)
            if lease is None:
                self.table.renew(lease_id, now, 0.0)  # raises the precise LeaseError
                raise LeaseError(lease_id, Refusal.UNKNOWN)
            if now >= lease.expiry:
                raise LeaseError(lease_id, Refusal.EXPIRED)
            if for_read:
                self._held_at[lease_id] = now  # a READ may run until now + read_timeout
            return sign(self._offers[lease_id])

    # -- internals -----------------------------------------------------------------------
    def _release_lru(self, short: Callable[[int], bool], now: float) -> list[str]:
        """Release least recently used leases while ``short(blocks due to come free by
        now)``; under the lock. Counted in `released_for_pressure`."""
        released: list[str] = []
        while short(sum(n for at, _, n in self._frees if at <= now)) and (
                victim := self.table.least_recent()) is not None:
            self._schedule(self.table.release(victim, now), now)
            released.append(victim)
        self.released_for_pressure += len(released)
        return released

    def _schedule(self, freed: list[FreeBlocks], now: float) -> None:
        for f in freed:
            self._offers.pop(f.lease_id, None)
            held = self._held_at.pop(f.lease_id, None)
            at = now if held is None else max(now, held + self.free_grace)
            self._frees.append((at, f.req_id, len(f.block_ids)))
            log.info("lease %s (request %s) ended: %s; %d blocks free in %.1fs", f.lease_id,
                     f.req_id, f.reason, len(f.block_ids), at - now)
