"""The demo's view of one streamed turn: TTFT, reply, and the router's reuse report,
which arrives as headers (pull) or as a choice-less SSE event (push)."""

from __future__ import annotations

import json

import httpx

from kvferry.scripts.demo import TurnResult, stream_chat


def _sse(events: list[dict]) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def _client(events: list[dict], headers: dict[str, str]) -> httpx.Client:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_sse(events),
                              headers={"content-type": "text/event-stream", **headers})
    return httpx.Client(transport=httpx.MockTransport(handler))


def _chunk(text: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


def test_pull_turn_reads_the_reuse_headers() -> None:
    with _client([_chunk("a"), _chunk("b")],
                 {"x-kvferry-reused-tokens": "128", "x-kvferry-reuse-reason": "ok",
                  "x-kvferry-prefill": "P", "x-kvferry-decode": "D"}) as c:
        res = stream_chat(c, "http://router", {})
    assert (res.reply, res.chunks, res.reused, res.reuse_reason) == ("ab", 2, 128, "ok")
    assert (res.prefill, res.decode) == ("P", "D")
    assert res.reuse_note() == "128 history tokens reused"


def test_push_turn_reads_the_reuse_event_and_does_not_count_it() -> None:
    events = [_chunk("x"), {"choices": [], "kvferry_prefill_ms": 3.5,
                            "kvferry_reused_tokens": 0,
                            "kvferry_reuse_reason": "local_hit_covers"}, _chunk("y")]
    with _client(events, {}) as c:
        res = stream_chat(c, "http://router", {})
    assert (res.reply, res.chunks, res.reused) == ("xy", 2, 0)
    assert res.reuse_note() == "0 history tokens reused (P's own prefix cache already held them)"


def test_unknown_reason_is_shown_as_is() -> None:
    res = TurnResult("", 0.1, 0.2, 1, "P", "D", 0, "lease_expiring")
    assert res.reuse_note() == "0 history tokens reused (lease_expiring)"


def test_d_local_turn_says_so() -> None:
    with _client([_chunk("z")], {"x-kvferry-route": "d_local", "x-kvferry-decode": "D"}) as c:
        res = stream_chat(c, "http://router", {})
    assert (res.route, res.prefill, res.decode) == ("d_local", "-", "D")
    assert res.reuse_note() == "served by D from its own cache (d_local)"
