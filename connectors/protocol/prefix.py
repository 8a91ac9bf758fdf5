"""Prefix hash chains: prove that two token prefixes agree without shipping the tokens.

Agents resend the whole history every turn, but clients edit it (drop tool output,
rewrite the system prompt), so before P reads D's KV for turn N it must know that D's
blocks hold exactly the tokens P is about to serve. D publishes one hash per full block;
hash ``i`` covers tokens ``[0, (i+1) * block_size)`` because it chains the previous hash,
so a match at block ``i`` implies a match of every earlier block.

The chain root binds the salt (tenant, model, anything that must never match across)
and the block size (the same tokens cut at another size are a different chain).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence

HASH_VERSION = b"kvferry-prefix-v1"
_DIGEST_BYTES = 16  # 128 bits: collisions are not a practical concern, hex stays short


def _root(block_size: int, salt: str | bytes) -> bytes:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    s = salt.encode() if isinstance(salt, str) else bytes(salt)
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    # Length-prefix every field so (salt, block_size) pairs can never alias each other.
    h.update(HASH_VERSION)
    h.update(struct.pack("<Q", len(s)))
    h.update(s)
    h.update(struct.pack("<Q", block_size))
    return h.digest()


def _chain(token_ids: Sequence[int], block_size: int, salt: str | bytes) -> Iterator[bytes]:
    prev = _root(block_size, salt)
    fmt = f"<{block_size}q"
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.blake2b(prev, digest_size=_DIGEST_BYTES)
        h.update(struct.pack(fmt, *token_ids[start:start + block_size]))
        prev = h.digest()
        yield prev


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str | bytes = b"") -> list[str]:
    """One hex hash per *full* block of ``token_ids`` (a trailing partial block has none).

    Token ids must fit in a signed 64-bit integer.
    """
    return [d.hex() for d in _chain(token_ids, block_size, salt)]


def matching_prefix_blocks(
    local_token_ids: Sequence[int],
    remote_hashes: Sequence[str],
    block_size: int,
    salt: str | bytes = b"",
) -> int:
    """How many leading full blocks of ``local_token_ids`` match ``remote_hashes``.

    Hashes are computed lazily and the scan stops at the first mismatch, so a client that
    edited turn 1 costs one block of hashing, not the whole prompt.
    """
    n = 0
    for mine, theirs in zip(_chain(local_token_ids, block_size, salt), remote_hashes,
                            strict=False):
        if not isinstance(theirs, str) or mine.hex() != theirs.lower():
            break
        n += 1
    return n


def matching_prefix_tokens(
    local_token_ids: Sequence[int],
    remote_hashes: Sequence[str],
    block_size: int,
    salt: str | bytes = b"",
) -> int:
    """Length in tokens of the longest full-block prefix both sides share."""
    return matching_prefix_blocks(local_token_ids, remote_hashes, block_size, salt) * block_size
