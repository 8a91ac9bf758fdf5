"""Prefix hash chains: chaining, salts, block sizes, edits."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.connectors.protocol.prefix import block_hashes, matching_prefix_blocks, matching_prefix_tokens

TOK = list(range(100, 200))


def test_one_hash_per_full_block():
    assert len(block_hashes(TOK, 16)) == 6  # 100 tokens: 6 full blocks, partial has none
    assert block_hashes(TOK[:15], 16) == []
    assert block_hashes([], 16) == []
    h = block_hashes(TOK, 16)
    assert all(isinstance(x, str) and len(x) == 32 for x in h) and len(set(h)) == 6


def test_deterministic_and_chained():
    a = block_hashes(TOK, 16)
    assert a == block_hashes(list(TOK), 16)
    edited = list(TOK)
    edited[3] = 7  # edit inside block 0 changes every later hash
    b = block_hashes(edited, 16)
    assert all(x != y for x, y in zip(a, b, strict=True))
    # edit in block 2 keeps blocks 0-1
    edited = list(TOK)
    edited[40] = 7
    c = block_hashes(edited, 16)
    assert c[:2] == a[:2] and all(x != y for x, y in zip(a[2:], c[2:], strict=True))


def test_prefix_property():
    assert block_hashes(TOK[:64], 16) == block_hashes(TOK, 16)[:4]


def test_salt_and_block_size_separate_chains():
    assert block_hashes(TOK, 16, "tenant-a")[0] != block_hashes(TOK, 16, "tenant-b")[0]
    assert block_hashes(TOK, 16, "x") == block_hashes(TOK, 16, b"x")
    assert block_hashes(TOK, 16)[1] != block_hashes(TOK, 32)[0]  # same 32 tokens


def test_bad_block_size():
    with pytest.raises(ValueError):
        block_hashes(TOK, 0)


def test_matching_prefix():
    remote = block_hashes(TOK, 16, "s")
    assert matching_prefix_tokens(TOK, remote, 16, "s") == 96
    assert matching_prefix_blocks(TOK, remote, 16, "s") == 6
    assert matching_prefix_tokens(TOK, remote, 16, "other") == 0
    assert matching_prefix_tokens(TOK[:50], remote, 16, "s") == 48  # local shorter
    assert matching_prefix_tokens(TOK, remote[:2], 16, "s") == 32  # remote shorter
    edited = list(TOK)
    edited[70] = 1
    assert matching_prefix_tokens(edited, remote, 16, "s") == 64
    assert matching_prefix_tokens(TOK, [r.upper() for r in remote], 16, "s") == 96
    assert matching_prefix_tokens(TOK, [None, *remote[1:]], 16, "s") == 0  # type: ignore[list-item]
    assert matching_prefix_tokens(TOK, [], 16, "s") == 0


@given(st.lists(st.integers(0, 50_000), max_size=80), st.lists(st.integers(0, 50_000),
       max_size=80), st.sampled_from([1, 4, 16]))
def test_match_equals_longest_common_full_block_prefix(a, b, bs):
    common = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        common += 1
    expect = min(common, len(a), len(b)) // bs * bs
    assert matching_prefix_tokens(a, block_hashes(b, bs), bs) == expect
