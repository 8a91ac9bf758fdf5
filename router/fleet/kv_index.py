"""Which prefill engine holds which prompt prefix, learned from vLLM's KV cache events.

vLLM publishes (``--kv-events-config``) a `BlockStored` event for every block it adds to
its prefix cache (its block hashes, the parent block's hash, the blocks' token ids) and a
`BlockRemoved` event when it evicts one; `AllBlocksCleared` when its cache is reset.
vLLM's block hashes depend on its hash function and seed, so the router keys blocks by a
hash of its own: a chain over the token ids (as `connectors.protocol.prefix` does), which
it can compute for a request's tokens. Each engine's index maps vLLM's hash to the
router's chain hash (to apply removals) and counts live blocks per chain hash.

Only plain blocks count: blocks with LoRA or extra keys (multimodal inputs, cache salts)
hold other KV for the same tokens, and non-GPU media or other KV cache groups are not
what a prefill hits. An index is bounded (LRU over its blocks): missed removals (events
dropped under load) age out instead of piling up, and an eviction costs at most a wrong
guess, never a wrong answer (the engine computes what it lacks).

Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

ROOT = b"kvferry-kv-index-v1"
MEDIA = (None, "GPU")
"""Media whose blocks a prefill hits directly (vLLM labels its own cache "GPU", also on
CPU builds; None: unspecified)."""


def _root(block_size: int) -> bytes:
    return hashlib.blake2b(ROOT + struct.pack("<Q", block_size), digest_size=16).digest()


def _next(prev: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


def chain(tokens: Sequence[int], block_size: int, limit: int | None = None) -> list[bytes]:
    """The router's hash of each full block of `tokens` (hash i covers blocks 0..i)."""
    out, prev = [], _root(block_size)
    n = len(tokens) // block_size if limit is None else min(limit, len(tokens) // block_size)
    for i in range(n):
        prev = _next(prev, tokens[i * block_size:(i + 1) * block_size])
        out.append(prev)
    return out


class EngineIndex:
    """One engine's cached blocks: vLLM hash -> router hash, and live counts per router hash."""

    def __init__(self, max_blocks: int = 1_000_000) -> None:
        self.max_blocks = max_blocks
        self._by_vllm: OrderedDict[Any, bytes] = OrderedDict()
        self._live: dict[bytes, int] = {}
        self.block_size: int | None = None

    def __len__(self) -> int:
        return len(self._by_vllm)

    def stored(self, hashes: Sequence[Any], parent: Any, tokens: Sequence[int],
               block_size: int) -> int:
        """Blocks `hashes` (in order, after `parent`) now hold `tokens`; returns how many
        were indexed (0 when the parent is unknown: that chain cannot be followed)."""
        if block_size <= 0 or len(tokens) < len(hashes) * block_size:
            return 0
        if self.block_size not in (None, block_size):
            return 0  # another KV cache group's size: not the one prompts are matched on
        if parent is None:
            prev = _root(block_size)
        elif (prev_h := self._by_vllm.get(_key(parent))) is not None:
            prev = prev_h
        else:
            return 0
        self.block_size = block_size
        for i, h in enumerate(hashes):
            prev = _next(prev, tokens[i * block_size:(i + 1) * block_size])
            key = _key(h)
            old = self._by_vllm.pop(key, None)
            if old is not None:
                self._dec(old)
            self._by_vllm[key] = prev
            self._live[prev] = self._live.get(prev, 0) + 1
        while len(self._by_vllm) > self.max_blocks:
            _, old = self._by_vllm.popitem(last=False)
            self._dec(old)
        return len(hashes)

    def removed(self, hashes: Iterable[Any]) -> None:
        for h in hashes:
            old = self._by_vllm.pop(_key(h), None)
            if old is not None:
                self._dec(old)

    def cleared(self) -> None:
        self._by_vllm.clear()
        self._live.clear()

    def matched_blocks(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of a request (router hashes from `chain`) this engine holds."""
        n = 0
        for h in hashes:
            if h not in self._live:
                break
            n += 1
        return n

    def _dec(self, h: bytes) -> None:
        left = self._live.get(h, 0) - 1
        if left > 0:
            self._live[h] = left
        else:
            self._live.pop(h, None)


def _key(h: Any) -> Any:
    return bytes(h) if isinstance(h, bytearray | memoryview) else h


def plain(event: Mapping[str, Any]) -> bool:
    """A block store the index may count (see the module docstring)."""
    if event.get("lora_name") or event.get("lora_id"):
        return False
    extra = event.get("extra_keys")
    if extra and any(e for e in extra):
        return False
    if event.get("group_idx") not in (None, 0):
        return False
    return event.get("medium") in MEDIA


class PrefixIndex:
    """Every prefill engine's index, by engine URL."""

    def __init__(self, max_blocks_per_engine: int = 1_000_000) -> None:
        self.max_blocks = max_blocks_per_engine
        self.engines: dict[str, EngineIndex] = {}

    def engine(self, url: str) -> EngineIndex:
        idx = self.engines.get(url)
        if idx is None:
            idx = self.engines[url] = EngineIndex(self.max_blocks)
        return idx

    def apply(self, url: str, events: Iterable[Any]) -> int:
        """Apply one batch of decoded events (dicts tagged by "type"); returns events used."""
        idx = self.engine(url)
        used = 0
        for ev in events:
            if not isinstance(ev, Mapping):
                continue
            kind = ev.get("type")
            if kind == "BlockStored" and plain(ev):
                hashes, tokens = ev.get("block_hashes"), ev.get("token_ids")
                bs = ev.get("block_size")
                if isinstance(hashes, list) and isinstance(tokens, list) and isinstance(bs, int):
                    used += bool(idx.stored(hashes, ev.get("parent_block_hash"), tokens, bs))
            elif kind == "BlockRemoved" and isinstance(ev.get("block_hashes"), list):
                if ev.get("group_idx") in (None, 0) and ev.get("medium") in MEDIA:
                    idx.removed(ev["block_hashes"])
                    used += 1
            elif kind == "AllBlocksCleared":
                idx.cleared()
                used += 1
        return used

    def forget(self, url: str) -> None:
        self.engines.pop(url, None)

    def matched_tokens(self, url: str, tokens: Sequence[int]) -> int:
        """Prompt tokens whose KV the engine at `url` holds (full blocks, leading)."""
        idx = self.engines.get(url)
        if idx is None or not idx.block_size or not len(idx):
            return 0
        return idx.matched_blocks(chain(tokens, idx.block_size)) * idx.block_size


def choose(candidates: Mapping[str, int], matched: Mapping[str, int], prompt_len: int,
           load_tokens: float) -> str | None:
    """The prefill with the least expected work: the prompt tokens it lacks, plus
    `load_tokens` per request it already has in flight. None when no engine holds any of
    the prompt (the pool's own least-loaded choice applies)."""
    if not candidates or not any(matched.get(u, 0) for u in candidates):
        return None

    def cost(url: str) -> tuple[float, int]:
        return (prompt_len - matched.get(url, 0) + load_tokens * candidates[url],
                -matched.get(url, 0))

    return min(candidates, key=cost)
