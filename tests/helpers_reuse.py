"""Reading D -> P reuse off real engines' answers: what the reuse engine tests
(test_e2e_reuse, test_e2e_2p2d, test_fleet_engines) compare against."""

from __future__ import annotations

import httpx

BS = 128  # CPU engines' block size


def out_tokens(resp: dict) -> list[int]:
    """The generated token ids of a completion (``return_token_ids``)."""
    return list(resp["choices"][0]["token_ids"])


def expected_reuse(prev_prompt: list[int], prev_out: list[int], new_prompt: list[int]) -> int:
    """Full blocks of D's KV (prompt + all but the last generated token) that P's new
    prompt starts with, never its last token."""
    held = prev_prompt + prev_out[:-1]
    same = 0
    while same < min(len(held), len(new_prompt)) and held[same] == new_prompt[same]:
        same += 1
    return min(same, len(held) // BS * BS, (len(new_prompt) - 1)) // BS * BS


def reused_of(headers: httpx.Headers, body: dict | None = None) -> int:
    """Tokens P read back from D: a header for pull; for push (whose P leg answers in the
    background) a field of D's body, which the router fills once P answered (it waits up to
    RouterSettings.push_report_wait_s for that: D may be read first)."""
    return int(headers.get("x-kvferry-reused-tokens")
               or (body or {}).get("kvferry_reused_tokens", 0))
