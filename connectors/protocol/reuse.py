"""P's decision for D->P reuse: how much of D's leased KV to READ before computing the rest.

On turn N+1 P first takes its own prefix-cache hit, then considers D's offer (the lease D
granted at the end of turn N, relayed by the router). It reads only tokens that are
1. beyond the local hit (vLLM loads external tokens right after the computed ones),
2. inside the prefix whose block hashes match P's prompt (clients edit history, and a
   stale or foreign block must never be read),
3. in full blocks, never including the last prompt token (vLLM must compute at least
   one token to produce logits),
4. from a lease that outlives the READ (``now + lease_margin < expiry``),
and only if that is at least ``kv_recompute_threshold`` tokens: a short span costs more
to coordinate than to recompute.

Block sizes. With equal P and D block sizes the read is block-for-block. When they differ
the read is restricted to spans aligned to ``lcm(p, d)`` tokens, so both sides move whole
blocks: the read starts at the local hit (which must itself be lcm-aligned, else nothing
is read: reason ``unaligned``) and ends at the last lcm boundary inside the usable prefix.
Token-granular mapping of partial blocks is left to a later transport.

Hashes follow `kvferry.connectors.protocol.prefix` with D's block size and the shared ``salt``
(model + tenant), so D's published hashes verify P's prompt directly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvferry.connectors.protocol.prefix import matching_prefix_tokens

DEFAULT_RECOMPUTE_THRESHOLD = 64  # kv_recompute_threshold
DEFAULT_LEASE_MARGIN = 2.0  # lease_margin_s: a READ may take this long, the lease must hold
DEFAULT_READ_TIMEOUT = 1.5  # reuse_read_timeout_s: P abandons a READ after this (< margin)

REASONS = ("ok", "no_offer", "invalid_offer", "local_hit_covers", "lease_expiring",
           "unaligned", "prefix_mismatch", "below_threshold")


@dataclass(frozen=True)
class RemoteOffer:
    """What D leased at the end of the previous turn (block locations only)."""

    lease_id: str
    num_tokens: int  # tokens D's blocks hold (prompt + generated)
    block_ids: tuple[int, ...]  # D's blocks, token order
    block_hashes: tuple[str, ...]  # prefix chain, one per full D block
    block_size: int  # D's tokens per block
    expiry: float  # lease expiry, on the clock ``now`` uses
    engine_id: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_ids", tuple(self.block_ids))
        object.__setattr__(self, "block_hashes", tuple(self.block_hashes))


@dataclass(frozen=True)
class Decision:
    """What P reads from D. ``tokens_to_read == 0`` unless ``reason == "ok"``."""

    reason: str
    tokens_to_read: int = 0
    first_token: int = 0  # read covers [first_token, first_token + tokens_to_read)
    remote_block_range: tuple[int, int] = (0, 0)  # [lo, hi) into offer.block_ids
    remote_block_ids: tuple[int, ...] = ()
    local_block_range: tuple[int, int] = (0, 0)  # [lo, hi) into P's request block table
    reusable_tokens: int = 0  # what passed every check but the threshold (metrics)

    @property
    def read(self) -> bool:
        return self.tokens_to_read > 0


def _floor(x: int, unit: int) -> int:
    return x // unit * unit


def decide_reuse(
    prompt_token_ids: Sequence[int],
    local_hit_tokens: int,
    offer: RemoteOffer | None,
    now: float,
    *,
    block_size: int,
    salt: str | bytes = b"",
    recompute_threshold: int = DEFAULT_RECOMPUTE_THRESHOLD,
    lease_margin: float = DEFAULT_LEASE_MARGIN,
) -> Decision:
    """Decide the D->P READ for one request; ``block_size`` is P's."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if offer is None:
        return Decision("no_offer")
    d_bs = offer.block_size
    if d_bs <= 0 or offer.num_tokens < 0 or any(b < 0 for b in offer.block_ids):
        return Decision("invalid_offer")
    unit = math.lcm(block_size, d_bs)
    cap = max(len(prompt_token_ids) - 1, 0)  # never read the last prompt token
    offered = _floor(min(offer.num_tokens, len(offer.block_ids) * d_bs,
                         len(offer.block_hashes) * d_bs), d_bs)
    best = _floor(min(offered, cap), unit)
    if best <= local_hit_tokens:
        # Nothing to read either way; but "covered" only if the offer is this prompt's
        # history: a turn sharing nothing with it (a short one, which P's cache covers
        # by its common head) did not match.
        head = _floor(min(offered, cap), d_bs)
        if matching_prefix_tokens(prompt_token_ids[:head], offer.block_hashes, d_bs,
                                  salt) < head:
            return Decision("prefix_mismatch")
        return Decision("local_hit_covers")
    if now + lease_margin >= offer.expiry:
        return Decision("lease_expiring")
    if local_hit_tokens < 0 or local_hit_tokens % unit:
        return Decision("unaligned")
    # Hash only what could be read: ``best`` is a multiple of d_bs.
    matched = matching_prefix_tokens(prompt_token_ids[:best], offer.block_hashes, d_bs, salt)
    end = _floor(min(matched, best), unit)
    if end <= local_hit_tokens:
        return Decision("prefix_mismatch")
    n = end - local_hit_tokens
    if n < recompute_threshold:
        return Decision("below_threshold", reusable_tokens=n)
    r_lo, r_hi = local_hit_tokens // d_bs, end // d_bs
    return Decision(
        "ok",
        tokens_to_read=n,
        first_token=local_hit_tokens,
        remote_block_range=(r_lo, r_hi),
        remote_block_ids=offer.block_ids[r_lo:r_hi],
        local_block_range=(local_hit_tokens // block_size, end // block_size),
        reusable_tokens=n,
    )
