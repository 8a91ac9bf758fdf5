"""Where a conversation turn is prefilled: on its own D from D's prefix cache (``d_local``),
or on P, reading the history back from D (``p_reuse``) or without history (``p_cold``).

Why: a follow-up turn is usually a short delta (a tool result, a user message) on a long
history that the conversation's D already holds under its lease. Served on D as a plain
request, vLLM's prefix cache hits the leased blocks and only the delta is computed: no P
leg, no READ of the history into P, no transfer of the new KV back (one H200, qwen3-8b,
history + 64 + 512 new tokens: 101 ms at 24k history against 154 ms for P + reuse on
H200 x2, 916 ms cold). The cost falls on D's other streams: their decode steps wait for
the delta's prefill (16 streams at 8k context: ITL p90 10.1 ms without such turns, 10.6 ms
at 2 turns/s of 576 new tokens, 38.8 ms at 5 turns/s). So the policy bounds both the
size of one D-local turn and the rate of D-local prefill tokens on a D that is busy:

- ``max_new_tokens`` (default 1024, 0: never D-local): twice the measured 576-token turn,
  so that turn stays local with room for the estimate's error; a bigger delta stalls D's
  streams for longer than P + reuse costs the turn itself, and goes to P.
- ``busy_tokens_per_s`` (default 1200): a token bucket per D of D-local prefill tokens,
  applied while D has other requests in flight (2 turns/s x 576 tokens kept ITL p90 within
  1.05x; 5 turns/s, 2880 tokens/s, made it 3.8x). An idle D always may; the tokens are
  still counted, so that a burst of turns landing on it at once is bounded too.
- ``max_in_flight`` (default 32): a D with this many requests open from this router gets
  no D-local turn (each delta would stall that many streams); 1: only an idle D.

New tokens are counted without a tokenizer or a round trip (`new_tokens`): exactly for
token-id prompts, from D's lease offer (its block hash chain against the request's
tokens); for chat and text prompts, from the characters beyond the recorded history
(`history.delta`) times the conversation's own tokens per character (the recorded turn's
usage when D reported it, else D's leased tokens plus one block), plus a few tokens per
new message (template) and the history's tail that D's full blocks do not cover.

Pure: no I/O; the clock is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvferry.connectors.protocol.prefix import matching_prefix_tokens

from .history import PromptView, delta

Route = Literal["d_local", "p_reuse", "p_cold"]
ROUTES: tuple[Route, ...] = ("d_local", "p_reuse", "p_cold")
MESSAGE_OVERHEAD_TOKENS = 8
"""Chat-template tokens per message beyond its text (role markers, separators)."""
TOKENS_PER_CHAR_BOUNDS = (1 / 16, 2.0)


@dataclass(frozen=True)
class PolicyConfig:
    """The D-local route's bounds (RouterSettings' d_local_* settings)."""

    max_new_tokens: int = 1024
    busy_tokens_per_s: float = 1200.0
    max_in_flight: int = 32
    chars_per_token: float = 3.0  # when a conversation has nothing to calibrate on

    @property
    def burst(self) -> float:
        return float(max(self.max_new_tokens, self.busy_tokens_per_s))


@dataclass(frozen=True)
class Decision:
    """Where a turn goes (P/D or D-local), why, and how many new tokens it brings."""

    route: Route
    reason: str
    new_tokens: int | None = None


def new_tokens(view: PromptView, history: Mapping[str, Any] | None, leased_tokens: int,
               offer: Mapping[str, Any] | None, chars_per_token: float = 3.0) -> int | None:
    """Tokens of this request beyond what its conversation's D holds, or None when the
    request does not continue the recorded history (then D's cache may hold little)."""
    if view.kind == "tokens":
        hashes, bs = (offer or {}).get("block_hashes"), (offer or {}).get("block_size")
        if not isinstance(hashes, list) or not isinstance(bs, int) or bs <= 0:
            return None
        held = matching_prefix_tokens(view.tokens, hashes, bs)
        return len(view.tokens) - min(held, len(view.tokens) - 1)  # the last one is computed
    d = delta(history, view)
    if d is None or history is None:
        return None
    chars = int(history["chars"])
    bs = (offer or {}).get("block_size")
    bs = bs if isinstance(bs, int) and bs > 0 else 0
    known = history.get("tokens")
    total = known if isinstance(known, int) and known > 0 else leased_tokens + bs
    if chars > 0 and total > 0:
        lo, hi = TOKENS_PER_CHAR_BOUNDS
        per_char = min(max(total / chars, lo), hi)
    else:
        per_char = 1.0 / chars_per_token
    tail = max(0, total - leased_tokens)
    return math.ceil(d.chars * per_char) + d.messages * MESSAGE_OVERHEAD_TOKENS + tail


@dataclass(frozen=True)
class Facts:
    """What the policy weighs for one turn. `sticky`: the D the router would decode on is
    the one holding the conversation's KV; `new`: the turn's new tokens (None: the history
    changed); `budget_ok`: D's token bucket covers `new`."""

    has_entry: bool
    sticky: bool
    new: int | None
    d_in_flight: int
    budget_ok: bool
    forced_prefill: bool = False


def decide(cfg: PolicyConfig, facts: Facts) -> Decision:
    """The route of one turn: the first rule `facts` fail names the reason."""
    has_entry, sticky, new = facts.has_entry, facts.sticky, facts.new
    d_in_flight, budget_ok, forced_prefill = facts.d_in_flight, facts.budget_ok, facts.forced_prefill
    if not has_entry:
        return Decision("p_cold", "no_history", new)
    if forced_prefill:
        return Decision("p_reuse", "client_asked", new)
    if cfg.max_new_tokens <= 0:
        return Decision("p_reuse", "disabled", new)
    if not sticky:
        return Decision("p_reuse", "decoder_moved", new)
    if new is None:
        return Decision("p_reuse", "history_changed", new)
    if new > cfg.max_new_tokens:
        return Decision("p_reuse", "long_turn", new)
    if d_in_flight >= cfg.max_in_flight:
        return Decision("p_reuse", "decoder_busy", new)
    if d_in_flight > 0 and not budget_ok:
        return Decision("p_reuse", "decoder_budget", new)
    return Decision("d_local", "short_turn", new)


class LocalBudget:
    """Per-D token bucket of D-local prefill tokens: refills at `rate` per second up to
    `burst`; a turn taken on an idle D may drive it below zero (repaid by later refills)."""

    MAX_KEYS = 1024

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self._level: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)

    def level(self, key: str, now: float) -> float:
        tokens, at = self._level.get(key, (self.burst, now))
        return min(self.burst, tokens + max(0.0, now - at) * self.rate)

    def allows(self, key: str, n: int, now: float) -> bool:
        return self.level(key, now) >= n

    def take(self, key: str, n: int, now: float) -> None:
        level = self.level(key, now) - n
        self._level.pop(key, None)
        self._level[key] = (level, now)  # most recently used last
        if len(self._level) > self.MAX_KEYS:  # forget full buckets (engines long idle or gone)
            for k in [k for k in self._level if self.level(k, now) >= self.burst]:
                del self._level[k]
            while len(self._level) > self.MAX_KEYS:  # then the least recently used
                del self._level[next(iter(self._level))]
