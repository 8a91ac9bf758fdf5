"""scripts/sse_client.events, the one SSE reader of `kvferry demo` and the chaos traffic,
and how each of them reports a stream that does not end well."""

from __future__ import annotations

import json

import httpx
import pytest

from kvferry.scripts import chaos_traffic
from kvferry.scripts.demo import DemoError, stream_chat
from kvferry.scripts.sse_client import StreamError, events


def sse(*items: dict | str, done: bool = True) -> list[str]:
    """SSE lines as httpx's iter_lines yields them (blank separators included)."""
    out: list[str] = []
    for it in items:
        out += [f"data: {it if isinstance(it, str) else json.dumps(it)}", ""]
    return out + (["data: [DONE]", ""] if done else [])


def test_events_in_order_until_done() -> None:
    lines = [": keep-alive", "event: message", *sse({"a": 1}, {"b": 2}), "data: {\"late\": 1}"]
    assert list(events(lines)) == [{"a": 1}, {"b": 2}]  # nothing after [DONE] is read
    assert list(events(["data:{\"tight\": 1}", "data:[DONE]"])) == [{"tight": 1}]


@pytest.mark.parametrize("lines, kind, detail", [
    (sse({"a": 1}, {"error": {"message": "decode died"}}), "error", "{'message': 'decode died'}"),
    (sse({"a": 1}, "not json"), "malformed", "not json"),
    (sse({"a": 1}, "[1, 2]"), "malformed", "[1, 2]"),
    (sse({"a": 1}, done=False), "truncated", "the stream ended without [DONE]"),
], ids=["error_event", "not_json", "not_object", "no_done"])
def test_a_bad_end_is_a_stream_error_with_its_kind(lines, kind, detail) -> None:
    seen = []
    with pytest.raises(StreamError) as e:
        seen.extend(events(lines))
    assert (e.value.kind, e.value.detail) == (kind, detail)
    assert seen == [{"a": 1}]  # the events before it were handed out


def test_an_empty_body_is_truncated() -> None:
    with pytest.raises(StreamError) as e:
        list(events([]))
    assert e.value.kind == "truncated"


def _item(endpoint: str) -> chaos_traffic.Item:
    body = (chaos_traffic.chat("m", [{"role": "user", "content": "hi"}], 4, True)
            if endpoint == "chat" else chaos_traffic.completion("m", [1, 2], 4, True))
    return chaos_traffic.Item(endpoint=endpoint, body=body, mode="pull")


def test_chaos_traffic_classifies_each_end() -> None:
    chunk = {"choices": [{"text": "a", "token_ids": [7]}]}
    raw = "\n".join
    item = _item("completions")
    assert chaos_traffic.classify(item, 200, raw(sse(chunk))) == ("ok", 200, "")
    assert chaos_traffic.streamed("completions", sse(chunk, chunk)) == \
        {"text": "aa", "tokens": [7, 7], "top": None}
    assert chaos_traffic.classify(item, 200, raw(sse(chunk, {"error": "boom"}))) == \
        ("error", 200, "error: boom")
    assert chaos_traffic.classify(item, 200, raw(sse(chunk, done=False))) == \
        ("truncated", 200, "truncated")
    kind, _, detail = chaos_traffic.classify(item, 200, raw(sse(chunk, "{oops")))
    assert (kind, detail) == ("unclear_error", "malformed: {oops")  # it raised before
    chat = {"choices": [{"delta": {"content": "hi"}}]}
    assert chaos_traffic.streamed("chat", sse(chat)) == {"text": "hi", "tokens": None, "top": None}


def _client(lines: list[str]) -> httpx.Client:
    body = "\n".join(lines).encode()
    return httpx.Client(transport=httpx.MockTransport(lambda _: httpx.Response(
        200, content=body, headers={"content-type": "text/event-stream"})))


@pytest.mark.parametrize("lines, message", [
    (sse({"choices": [{"delta": {"content": "a"}}]}, {"error": "boom"}), "stream error: boom"),
    (sse({"choices": [{"delta": {"content": "a"}}]}, done=False), "stream ended without [DONE]"),
    (sse(done=False), "empty stream"),
    (sse({"choices": []}), "empty stream"),
    (sse("{oops"), "stream event is no JSON object: {oops"),
], ids=["error_event", "no_done", "nothing", "no_chunk", "malformed"])
def test_demo_names_each_bad_end(lines, message) -> None:
    with _client(lines) as c, pytest.raises(DemoError) as e:
        stream_chat(c, "http://router", {})
    assert str(e.value) == message
