"""A stream's plain token events matched on their shared bytes (`TokenShape`): an event
it accepts is one `plain_token_ids` accepts, with the same id and span, and the rewriter
that uses it writes the same bytes and records the same tokens as the one that parses."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from kvferry.router.wire.resume import EventRewriter
from kvferry.router.wire.resume_request import Progress
from kvferry.router.wire.sse_filters import EngineFieldFilter
from kvferry.router.wire.sse_framing import TokenShape, plain_token_ids

# Texts a model may write, the JSON-looking ones included (they arrive escaped).
_PIECES = [" t", "x", '"', "\\", '","logprobs":null,', '"},"logprobs":null,', "]}]}\n\n",
           "\n", "é", "日本", "\u2028", "}", "[1]", '"token_ids":[5]', "\\\"", "\t"]


def _completion(text: str, tid: int, *, rid: str = "cmpl-1", ascii_: bool = True,
                top: dict[str, Any] | None = None, **more: Any) -> bytes:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                              "finish_reason": None, "stop_reason": None,
                              "prompt_token_ids": None, "token_ids": [tid]}
    choice.update(more)
    obj = {"id": rid, "object": "text_completion", "created": 5, "model": "qwen/q",
           "choices": [choice], "usage": None, **(top or {})}
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=ascii_
                                  ).encode() + b"\n\n"


def _chat(text: str, tid: int, **more: Any) -> bytes:
    choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None,
                              "finish_reason": None, "token_ids": [tid]}
    choice.update(more)
    obj = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5,
           "model": "m", "choices": [choice]}
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _learnt(event: bytes) -> TokenShape:
    found = plain_token_ids(event)
    assert found is not None
    shape = TokenShape.of(event, found[1:])
    assert shape is not None
    return shape


@pytest.mark.parametrize("make", [_completion, _chat])
@pytest.mark.parametrize("ascii_", [True, False])
def test_a_match_is_what_plain_token_ids_finds(make: Any, ascii_: bool) -> None:
    rng = random.Random(3)
    kw = {"ascii_": ascii_} if make is _completion else {}
    shape = _learnt(make(" a", 17, **kw))
    matched = 0
    for _ in range(4000):
        text = "".join(rng.choice(_PIECES) for _ in range(rng.randrange(0, 4)))
        event = make(text, rng.randrange(0, 200_000), **kw)
        got = shape.match(event)
        found = plain_token_ids(event)
        assert found is not None, event
        if got is not None:
            matched += 1
            ids, start, end = found
            assert got == (ids[0], start, end), event
        else:  # only a quote in the text (escaped, or the backslash's own escape) declines
            assert b'\\"' in event or b"\\\\" in event, event
    assert matched > 1000


def test_other_shapes_are_declined() -> None:
    shape = _learnt(_completion(" a", 1))
    plain = _completion(" b", 2)
    assert shape.match(plain) == (2, plain.index(b'"token_ids"'), plain.index(b"]}]") + 1)
    for event in (
            _completion(" b", 2, finish_reason="length"),
            _completion(" b", 2, logprobs={"tokens": ["b"]}),
            _completion(" b", 2, prompt_token_ids=[1, 2]),
            _completion(" b", 2, top={"kv_transfer_params": {"lease": "x"}}),
            _completion(" b", 2, rid="cmpl-2"),  # another stream
            _completion(" b", 2).replace(b'"token_ids":[2]', b'"token_ids":[2,3]'),
            _completion(" b", 2).replace(b'"token_ids":[2]', b'"token_ids":[]'),
            _completion(" b", 2).replace(b"\n\n", b"\r\n\r\n"),
            _completion(" b", 2)[:-2],  # no blank line yet
            _completion(" b", 2) + _completion(" c", 3),  # two events in one chunk
            _chat(" b", 2),
            b'data: {"error":{"message":"boom"}}\n\n',
            b"data: [DONE]\n\n"):
        assert shape.match(event) is None, event


def test_only_plain_texts_without_quotes_teach_a_shape() -> None:
    for text in ('a"b', "a\\b"):
        event = _completion(text, 3)
        found = plain_token_ids(event)
        assert found is not None and TokenShape.of(event, found[1:]) is None


def _stream(texts: list[str], want_last_params: bool) -> list[bytes]:
    first = _completion(texts[0], 100, prompt_token_ids=[1, 2, 3])
    events = [first, *(_completion(t, 100 + i) for i, t in enumerate(texts[1:-1], 1))]
    top = {"kv_transfer_params": {"lease": "x"}} if want_last_params else None
    events.append(_completion(texts[-1], 100 + len(texts) - 1, top=top, finish_reason="length"))
    return [*events, b"data: [DONE]\n\n"]


@pytest.mark.parametrize("want_ids", [False, True])
def test_rewriter_with_shapes_writes_what_parsing_writes(want_ids: bool) -> None:
    """Over streams with quoted, escaped and JSON-looking texts: the bytes, recorded tokens
    and engine-field callbacks equal those of a rewriter that parses every event (logprobs
    requested elsewhere turn the byte paths off: here the parsed reference is built by
    decoding and re-encoding each event the way the parse path does)."""
    rng = random.Random(11)
    for _ in range(60):
        texts = ["".join(rng.choice(_PIECES) for _ in range(rng.randrange(0, 3)))
                 for _ in range(rng.randrange(2, 30))]
        events = _stream(texts, rng.random() < 0.5)
        seen: list = []
        p = Progress("completions", want_ids=want_ids)
        rw = EventRewriter(p, then=EngineFieldFilter(seen.append))
        out = b"".join(rw.feed(e) for e in events) + rw.flush()
        got = [json.loads(e[6:]) for e in out.split(b"\n\n") if e and e != b"data: [DONE]"]
        want = [json.loads(e[6:]) for e in events[:-1]]
        for w in want:
            w.pop("kv_transfer_params", None)
            if not want_ids:
                w["choices"][0]["token_ids"] = None
                w["choices"][0]["prompt_token_ids"] = None
        assert got == want
        assert seen == ([{"lease": "x"}] if b"lease" in events[-2] else [])
        assert p.sent == [100 + i for i in range(len(texts))]
        assert out.endswith(b"data: [DONE]\n\n") and rw.broken() is None
        assert p.prompt_ids == [1, 2, 3] and p.events == len(texts)
