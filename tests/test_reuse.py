"""D->P reuse decision: threshold, lease margin, prefix guard, block sizes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.connectors.protocol.prefix import block_hashes
from kvferry.connectors.protocol.reuse import REASONS, Decision, RemoteOffer, decide_reuse

SALT = "model:tenant"
PROMPT = list(range(1000, 1300))  # 300 tokens


def offer(tokens=PROMPT[:260], bs=16, expiry=100.0, salt=SALT, n=None) -> RemoteOffer:
    hashes = block_hashes(tokens, bs, salt)
    return RemoteOffer("lease-1", len(tokens) if n is None else n,
                       tuple(range(500, 500 + -(-len(tokens) // bs))), tuple(hashes), bs,
                       expiry, "d0")


def decide(prompt=PROMPT, hit=0, off=None, now=0.0, bs=16, **kw) -> Decision:
    return decide_reuse(prompt, hit, offer() if off is None else off, now,
                        block_size=bs, salt=SALT, **kw)


def test_ok_equal_block_sizes():
    d = decide(hit=32)
    # D holds 260 tokens -> 16 full blocks = 256 tokens; read [32, 256)
    assert d.reason == "ok" and d.read
    assert (d.first_token, d.tokens_to_read) == (32, 224)
    assert d.remote_block_range == (2, 16) and d.local_block_range == (2, 16)
    assert d.remote_block_ids == tuple(range(502, 516))


def test_no_offer_and_invalid_offer():
    assert decide_reuse(PROMPT, 0, None, 0.0, block_size=16).reason == "no_offer"
    o = offer()
    bad = RemoteOffer(o.lease_id, o.num_tokens, o.block_ids, o.block_hashes, 0, o.expiry)
    assert decide(off=bad).reason == "invalid_offer"
    bad = RemoteOffer(o.lease_id, o.num_tokens, (-1, *o.block_ids[1:]), o.block_hashes, 16, 9.0)
    assert decide(off=bad).reason == "invalid_offer"
    with pytest.raises(ValueError):
        decide(bs=0)


def test_threshold_boundary():
    # hit 192 -> 64 tokens reusable: exactly the threshold reads
    assert decide(hit=192).tokens_to_read == 64
    d = decide(hit=208)
    assert d.reason == "below_threshold" and d.tokens_to_read == 0 and d.reusable_tokens == 48
    assert decide(hit=208, recompute_threshold=48).reason == "ok"


def test_local_hit_covers():
    assert decide(hit=256).reason == "local_hit_covers"
    assert decide(hit=288).reason == "local_hit_covers"


def test_lease_margin_boundary():
    assert decide(now=98.0, lease_margin=2.0).reason == "lease_expiring"
    assert decide(now=97.99, lease_margin=2.0).reason == "ok"
    assert decide(now=200.0).reason == "lease_expiring"


def test_prefix_mismatch_and_partial_match():
    edited = list(PROMPT)
    edited[5] = 0  # history edited in block 0: nothing reusable
    assert decide(prompt=edited).reason == "prefix_mismatch"
    edited = list(PROMPT)
    edited[100] = 0  # block 6 differs: read only blocks [0, 6)
    d = decide(prompt=edited)
    assert d.reason == "ok" and d.tokens_to_read == 96 and d.remote_block_range == (0, 6)
    assert decide(prompt=edited, hit=96).reason == "prefix_mismatch"
    other_tenant = offer(salt="model:other")
    assert decide(off=other_tenant).reason == "prefix_mismatch"


def test_never_reads_last_prompt_token():
    # D holds exactly the whole 256-token prompt: reading stops one block short
    prompt = PROMPT[:256]
    d = decide(prompt=prompt, off=offer(tokens=prompt))
    assert d.tokens_to_read == 240 and d.first_token + d.tokens_to_read < len(prompt)
    prompt = PROMPT[:257]  # one extra token to compute: full 256 readable
    assert decide(prompt=prompt, off=offer(tokens=PROMPT[:256])).tokens_to_read == 256
    assert decide(prompt=[], off=offer()).reason == "local_hit_covers"


def test_offer_capped_by_num_tokens_blocks_and_hashes():
    o = offer()
    short = RemoteOffer(o.lease_id, 100, o.block_ids, o.block_hashes, 16, o.expiry)
    assert decide(off=short).tokens_to_read == 96
    few_blocks = RemoteOffer(o.lease_id, o.num_tokens, o.block_ids[:5], o.block_hashes, 16,
                             o.expiry)
    assert decide(off=few_blocks).tokens_to_read == 80
    few_hashes = RemoteOffer(o.lease_id, o.num_tokens, o.block_ids, o.block_hashes[:4], 16,
                             o.expiry)
    assert decide(off=few_hashes).tokens_to_read == 64


def test_different_block_sizes_use_lcm():
    # P 16, D 32: unit 32. D has 260 tokens -> 8 D blocks = 256 tokens.
    d = decide(off=offer(bs=32), bs=16)
    assert d.reason == "ok" and d.tokens_to_read == 256
    assert d.remote_block_range == (0, 8) and d.local_block_range == (0, 16)
    d = decide(hit=64, off=offer(bs=32), bs=16)
    assert d.remote_block_range == (2, 8) and d.local_block_range == (4, 16)
    assert decide(hit=48, off=offer(bs=32), bs=16).reason == "unaligned"
    # P 16, D 24: unit 48 -> 240 of 256 usable tokens (D: 10 full blocks = 240)
    d = decide(off=offer(bs=24), bs=16)
    assert d.tokens_to_read == 240 and d.remote_block_range == (0, 10)
    assert d.local_block_range == (0, 15)


@given(st.integers(0, 300), st.integers(0, 20), st.sampled_from([8, 16, 32]),
       st.sampled_from([16, 32, 48]), st.floats(0, 200), st.integers(0, 128))
def test_decision_invariants(prompt_len, hit_blocks, p_bs, d_bs, now, threshold):
    prompt = PROMPT[:prompt_len]
    hit = min(hit_blocks * p_bs, max(prompt_len - 1, 0) // p_bs * p_bs)
    o = offer(bs=d_bs)
    d = decide_reuse(prompt, hit, o, now, block_size=p_bs, salt=SALT,
                     recompute_threshold=threshold, lease_margin=2.0)
    assert d.reason in REASONS
    if not d.read:
        assert d.tokens_to_read == 0 and d.remote_block_ids == ()
        return
    end = d.first_token + d.tokens_to_read
    assert d.reason == "ok" and d.first_token == hit
    assert d.tokens_to_read >= threshold and d.tokens_to_read >= 1
    assert end <= len(prompt) - 1 and end <= o.num_tokens
    assert now + 2.0 < o.expiry
    assert d.first_token % d_bs == 0 and end % d_bs == 0 and end % p_bs == 0
    lo, hi = d.remote_block_range
    assert (lo * d_bs, hi * d_bs) == (d.first_token, end)
    assert d.remote_block_ids == o.block_ids[lo:hi]
    assert block_hashes(prompt[:end], d_bs, SALT) == list(o.block_hashes[:hi])


def test_a_turn_sharing_nothing_with_the_history_did_not_match():
    """Issue 37 item 10: a short turn P's own cache covers is "local_hit_covers" only when
    it continues the offered history; one sharing nothing with it is a mismatch."""
    other = [t + 7000 for t in PROMPT[:40]]
    assert decide(prompt=other, hit=32).reason == "prefix_mismatch"
    assert decide(prompt=PROMPT[:40], hit=32).reason == "local_hit_covers"
