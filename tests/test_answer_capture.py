"""router/conversations/answer_capture.py: the answer the client got, from JSON and from SSE (pure)."""

from __future__ import annotations

import json

from kvferry.router.conversations.answer_capture import AnswerCapture, answer_of_json
from kvferry.router.conversations.history import Answer


def sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode()
                    for e in events)


def delta(content: str | None = None, index: int = 0, **fields) -> dict:
    d = {"role": "assistant", **({"content": content} if content is not None else {}), **fields}
    return {"id": "x", "choices": [{"index": index, "delta": d, "finish_reason": None}]}


CHAT_STREAM = sse(delta(""), delta("Hel"), delta("lo, "), delta("ferry."),
                  {"id": "x", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                   "kv_transfer_params": None},
                  {"id": "x", "choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 4}},
                  "[DONE]")


def run(data: bytes, chat: bool = True, cut: list[int] | None = None) -> tuple[bytes, list]:
    got: list = []
    cap = AnswerCapture(chat, got.append)
    out = b""
    pos = 0
    for c in [*(cut or []), len(data)]:
        out += cap.feed(data[pos:c])
        pos = c
    out += cap.flush()
    cap.finish()  # a clean end after [DONE] reports nothing twice
    return out, got


def test_stream_passes_bytes_through_and_collects_choice_0_at_every_split():
    want = Answer("Hello, ferry.", (), 34)
    for i in range(1, len(CHAT_STREAM)):
        out, got = run(CHAT_STREAM, cut=[i])
        assert out == CHAT_STREAM and got == [want], i


def test_done_is_reported_inside_the_feed_that_carries_it():
    got: list = []
    cap = AnswerCapture(True, got.append)
    body, done = CHAT_STREAM[:-len(b"data: [DONE]\n\n")], b"data: [DONE]\n\n"
    cap.feed(body)
    assert got == []
    assert cap.feed(done) == done and len(got) == 1  # before the bytes went to the client


def test_tool_call_deltas_are_merged():
    stream = sse(
        delta(None, tool_calls=[{"index": 0, "id": "call-1", "type": "function",
                                 "function": {"name": "look", "arguments": ""}}]),
        delta(None, tool_calls=[{"index": 0, "function": {"name": "up", "arguments": '{"q":'}}]),
        delta(None, tool_calls=[{"index": 0, "function": {"arguments": "1}"}}]),
        delta(None, tool_calls=[{"index": 1, "id": "call-2", "function": {"name": "g",
                                                                            "arguments": "{}"}}]),
        "[DONE]")
    _, [ans] = run(stream)
    assert ans.text == "" and [c["function"] for c in ans.tool_calls] == [
        {"name": "lookup", "arguments": '{"q":1}'}, {"name": "g", "arguments": "{}"}]
    assert [c["id"] for c in ans.tool_calls] == ["call-1", "call-2"]


def test_unfollowable_streams_report_none():
    for bad in (sse(delta("a"), delta("b", index=1), "[DONE]"),  # n=2
                sse(delta("a"), {"error": {"message": "boom"}}, "[DONE]"),
                b"data: {not json\n\n" + sse("[DONE]")):
        assert run(bad)[1] == [None], bad


def test_router_report_event_and_comments_are_ignored():
    stream = (b": keep-alive\n\n" + sse(delta("x"))
              + sse({"choices": [], "kvferry_prefill_ms": 3.0}, "[DONE]"))
    assert run(stream)[1] == [Answer("x")]


def test_a_stream_without_done_reports_at_its_clean_end():
    got: list = []
    cap = AnswerCapture(True, got.append)
    cap.feed(sse(delta("par")) + b"data: " + json.dumps(delta("tial")).encode())
    assert got == []
    cap.flush()
    cap.finish()
    assert got == [Answer("partial")]


def test_completions_and_json_answers():
    stream = sse({"choices": [{"index": 0, "text": "Once "}]},
                 {"choices": [{"index": 0, "text": "upon", "finish_reason": "length"}]}, "[DONE]")
    assert run(stream, chat=False)[1] == [Answer("Once upon")]
    chat_json = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi",
                                                      "refusal": None}}],
                 "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}}
    assert answer_of_json(json.dumps(chat_json).encode(), True) == Answer("hi", (), 8)
    text_json = {"choices": [{"index": 0, "text": "t"}]}
    assert answer_of_json(json.dumps(text_json).encode(), False) == Answer("t")
    two = {"choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}]}
    assert answer_of_json(json.dumps(two).encode(), False) is None
    assert answer_of_json(b"not json", True) is None
