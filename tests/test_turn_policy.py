"""router/conversations/turn_policy.py: where each turn is prefilled, and how its new tokens are counted
(pure; the whole decision space is enumerated)."""

from __future__ import annotations

import itertools
import math

import pytest

from kvferry.connectors.protocol.prefix import block_hashes
from kvferry.router.conversations.history import Answer, record, view_of
from kvferry.router.conversations.turn_policy import (
    MESSAGE_OVERHEAD_TOKENS,
    Facts,
    LocalBudget,
    PolicyConfig,
    decide,
    new_tokens,
)

CFG = PolicyConfig(max_new_tokens=100, busy_tokens_per_s=50.0, max_in_flight=4)
BS = 16


def test_every_combination_follows_the_rules_in_order():
    """d_local iff every condition holds; otherwise the first failing one names the reason."""
    grid = itertools.product(
        (False, True),  # has_entry
        (False, True),  # forced_prefill
        (0, 100),  # max_new_tokens (0: off)
        (False, True),  # sticky
        (None, 0, 1, 99, 100, 101, 10_000),  # new tokens
        (0, 1, 3, 4, 5),  # D's requests in flight (max 4)
        (False, True),  # D's budget covers it
    )
    seen = set()
    for has, forced, cap, sticky, new, busy, budget in grid:
        cfg = PolicyConfig(cap, CFG.busy_tokens_per_s, CFG.max_in_flight)
        d = decide(cfg, Facts(has_entry=has, sticky=sticky, new=new, d_in_flight=busy,
                              budget_ok=budget, forced_prefill=forced))
        checks = [("no_history", has), ("client_asked", not forced), ("disabled", cap > 0),
                  ("decoder_moved", sticky), ("history_changed", new is not None),
                  ("long_turn", new is not None and new <= cap),
                  ("decoder_busy", busy < CFG.max_in_flight),
                  ("decoder_budget", busy == 0 or budget)]
        failed = [name for name, ok in checks if not ok]
        if not failed:
            assert (d.route, d.reason) == ("d_local", "short_turn")
        else:
            assert d.reason == failed[0]
            assert d.route == ("p_cold" if not has else "p_reuse")
        assert d.new_tokens == new
        seen.add(d.reason)
    assert len(seen) == 9  # every reason is reachable


def test_an_idle_decoder_takes_a_short_turn_whatever_its_budget():
    d = decide(CFG, Facts(has_entry=True, sticky=True, new=100, d_in_flight=0, budget_ok=False))
    assert d.route == "d_local"
    d = decide(CFG, Facts(has_entry=True, sticky=True, new=100, d_in_flight=1, budget_ok=False))
    assert (d.route, d.reason) == ("p_reuse", "decoder_budget")
    one = PolicyConfig(max_in_flight=1)
    assert decide(one, Facts(has_entry=True, sticky=True, new=5, d_in_flight=1,
                             budget_ok=True)).reason == "decoder_busy"


def test_defaults_are_the_documented_ones():
    cfg = PolicyConfig()
    assert (cfg.max_new_tokens, cfg.busy_tokens_per_s, cfg.max_in_flight) == (1024, 1200.0, 32)
    assert cfg.burst == 1200.0
    assert PolicyConfig(max_new_tokens=4096, busy_tokens_per_s=100).burst == 4096


def test_budget_refills_caps_and_can_be_overdrawn_by_an_idle_turn():
    b = LocalBudget(rate=100.0, burst=200.0)
    assert b.level("d", 0.0) == 200.0 and b.allows("d", 200, 0.0) and not b.allows("d", 201, 0.0)
    b.take("d", 150, 0.0)
    assert b.level("d", 0.0) == 50.0 and not b.allows("d", 60, 0.0)
    assert b.level("d", 0.1) == pytest.approx(60.0) and b.allows("d", 60, 0.1)
    assert b.level("d", 100.0) == 200.0  # capped at the burst
    b.take("d", 500, 100.0)  # taken on an idle D: overdrawn, repaid by refills
    assert b.level("d", 100.0) == -300.0 and b.level("d", 104.0) == pytest.approx(100.0)
    assert b.level("other", 0.0) == 200.0  # per D
    b.take("x", 1, 0.0)
    for i in range(LocalBudget.MAX_KEYS + 5):  # bounded: full buckets are forgotten
        b.take(f"d{i}", 1, 1000.0)
    assert len(b._level) <= LocalBudget.MAX_KEYS
    assert b.level("d1028", 1000.0) == 199.0  # the most recent ones are kept


def offer_for(tokens: list[int]) -> dict:
    return {"block_size": BS, "block_hashes": block_hashes(tokens, BS), "num_tokens":
            len(tokens) // BS * BS}


def test_token_prompts_are_counted_exactly_from_d_s_block_hashes():
    held = list(range(100, 100 + 5 * BS + 3))  # D leased 5 full blocks
    offer = offer_for(held)
    nxt = held + list(range(7, 7 + 40))
    assert new_tokens(view_of({"prompt": nxt}), None, 5 * BS, offer) == len(nxt) - 5 * BS
    edited = list(nxt)
    edited[2 * BS + 1] += 1  # the client changed something in block 2
    assert new_tokens(view_of({"prompt": edited}), None, 5 * BS, offer) == len(nxt) - 2 * BS
    # D holding the whole prompt still computes its last token.
    assert new_tokens(view_of({"prompt": held[:5 * BS]}), None, 5 * BS, offer) == 1
    assert new_tokens(view_of({"prompt": nxt}), None, 5 * BS, {}) is None
    assert new_tokens(view_of({"prompt": nxt}), None, 5 * BS, {**offer, "block_size": 0}) is None


SYS = {"role": "system", "content": "s" * 300}
U1 = {"role": "user", "content": "u" * 100}
A1 = Answer("a" * 200)


def chat(*msgs: dict) -> dict:
    return {"model": "m", "messages": list(msgs)}


def test_chat_turns_are_estimated_with_the_conversation_s_own_tokens_per_char():
    view1 = view_of(chat(SYS, U1))
    u2 = {"role": "user", "content": "q" * 120}
    nxt = view_of(chat(SYS, U1, {"role": "assistant", "content": A1.text}, u2))
    # D reported usage (a JSON answer): 150 tokens for 600 chars; 128 of them leased.
    rec = record(view1, Answer(A1.text, (), tokens=150))
    got = new_tokens(nxt, rec, 128, {"block_size": 64})
    assert got == math.ceil(120 * 150 / 600) + MESSAGE_OVERHEAD_TOKENS + (150 - 128)
    # A stream without usage: D's leased tokens plus one block bound the history.
    rec = record(view1, A1)
    got = new_tokens(nxt, rec, 128, {"block_size": 64})
    assert got == math.ceil(120 * 192 / 600) + MESSAGE_OVERHEAD_TOKENS + 64
    # Nothing to calibrate on (no characters): the configured chars per token.
    empty = record(view_of(chat({"role": "user", "content": ""})), Answer(""))
    later = view_of(chat({"role": "user", "content": ""}, {"role": "assistant", "content": ""},
                         {"role": "user", "content": "x" * 30}))
    assert new_tokens(later, empty, 0, {}, chars_per_token=3.0) == 10 + MESSAGE_OVERHEAD_TOKENS
    # Not a continuation of what D holds: unknown.
    assert new_tokens(view_of(chat(SYS, u2)), rec, 128, {"block_size": 64}) is None
    assert new_tokens(nxt, None, 128, {"block_size": 64}) is None
    assert new_tokens(nxt, {}, 128, {}) is None


def test_a_long_paste_is_a_long_turn():
    rec = record(view_of(chat(SYS, U1)), Answer(A1.text, (), tokens=150))
    paste = {"role": "user", "content": "p" * 8000}
    n = new_tokens(view_of(chat(SYS, U1, {"role": "assistant", "content": A1.text}, paste)),
                   rec, 128, {"block_size": 64})
    assert n is not None and n > PolicyConfig().max_new_tokens
