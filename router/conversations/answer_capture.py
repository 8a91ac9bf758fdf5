"""The answer D gave, as the client received it: choice 0's text and tool calls, and the
usage D reported, from a JSON answer or from the SSE events on their way to the client.

A conversation's next request resends that answer as an assistant message, so it is
part of the history the router records (`history.record`). The stream filter passes every
byte through unchanged and keeps a copy, parsed once at the end; `on_done` fires once, when
the `data: [DONE]` event has been seen (within the same `feed` call, so before the client has
it, which lets the conversation commit before the client's next turn can arrive).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from ..wire.sse_framing import event_ends
from .history import Answer

DONE = b"[DONE]"


class Collector:
    """Accumulates choice 0 across events; `answer()` is None once anything made the
    answer unknowable (a second choice, an error event, an unparsable event)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.parts: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.tokens: int | None = None
        self.broken = False

    def add(self, obj: Any) -> None:
        if not isinstance(obj, dict) or "error" in obj:
            self.broken = True
            return
        usage = obj.get("usage")
        if isinstance(usage, dict):
            p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(p, int) and isinstance(c, int):
                self.tokens = p + c
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                self.broken = True
                continue
            if choice.get("index", 0) != 0:
                self.broken = True
                continue
            if self.chat:
                self._chat(choice.get("delta") if "delta" in choice else choice.get("message"))
            elif isinstance(choice.get("text"), str):
                self.parts.append(choice["text"])

    def _chat(self, msg: Any) -> None:
        if not isinstance(msg, dict):
            return
        if isinstance(msg.get("content"), str):
            self.parts.append(msg["content"])
        for i, call in enumerate(msg.get("tool_calls") or ()):
            if not isinstance(call, dict):
                continue
            idx = call.get("index", i)
            slot = self.calls.setdefault(idx if isinstance(idx, int) else i,
                                         {"id": None, "type": "function",
                                          "function": {"name": "", "arguments": ""}})
            if call.get("id"):
                slot["id"] = call["id"]
            if call.get("type"):
                slot["type"] = call["type"]
            fn = call.get("function")
            if isinstance(fn, dict):
                if fn.get("name"):
                    slot["function"]["name"] += str(fn["name"])
                if fn.get("arguments"):
                    slot["function"]["arguments"] += str(fn["arguments"])

    def answer(self) -> Answer | None:
        if self.broken:
            return None
        calls = tuple(self.calls[k] for k in sorted(self.calls))
        return Answer("".join(self.parts), calls, self.tokens)


def answer_of_json(data: bytes, chat: bool) -> Answer | None:
    """Choice 0 of a JSON answer, or None."""
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    c = Collector(chat)
    c.add(obj)
    return c.answer()


class AnswerCapture:
    """A `sse_filters.ChunkFilter` that returns its input unchanged and collects the answer.

    On the token path it only keeps the chunks (raw bytes) and looks for `[DONE]`; the
    events are parsed once, when `[DONE]` arrives (or the stream ends), not per chunk."""

    def __init__(self, chat: bool, on_done: Callable[[Answer | None], None]) -> None:
        self.collector = Collector(chat)
        self._on_done: Callable[[Answer | None], None] | None = on_done
        self._chunks: list[bytes] = []
        self._tail = b""  # the previous chunk's last bytes: a marker split across chunks
        self._done_seen = False

    def feed(self, chunk: bytes) -> bytes:
        if self._on_done is None:
            return chunk  # the answer is reported: the rest is of no use
        self._chunks.append(chunk)
        if self._done_seen or DONE in self._tail + chunk:
            self._done_seen = True
            self._parse(final=False)
        self._tail = chunk[-len(DONE) + 1:]
        return chunk

    def flush(self) -> bytes:
        self._parse(final=True)
        return b""

    def _parse(self, final: bool) -> None:
        """Every complete event kept so far (with `final`, the unterminated rest too)."""
        data = b"".join(self._chunks)
        end = 0
        for start, stop in event_ends(data):
            self._event(data[end:start])
            end = stop
        rest = data[end:]
        if final and rest.strip():
            self._event(rest)
            rest = b""
        self._chunks = [rest] if rest else []

    def finish(self) -> None:
        """The stream ended cleanly without `[DONE]`: report what was collected."""
        if self._on_done is not None:
            self._parse(final=True)
        self._done()

    def _done(self) -> None:
        if self._on_done is not None:
            done, self._on_done = self._on_done, None
            done(self.collector.answer())

    def _event(self, event: bytes) -> None:
        lines = [ln[5:].removeprefix(b" ") for ln in event.splitlines() if ln.startswith(b"data:")]
        if not lines:
            return
        payload = b"\n".join(lines)
        if payload.strip() == DONE:
            self._done()
            return
        try:
            obj = msgspec.json.decode(payload)
        except msgspec.DecodeError:
            self.collector.broken = True
            return
        if isinstance(obj, dict) and obj.get("choices") == [] and "usage" not in obj:
            return  # the router's own report event (push), not D's answer
        self.collector.add(obj)
