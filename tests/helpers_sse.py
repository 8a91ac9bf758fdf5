"""A strict reader of vLLM's streaming format, for the router's streams (fake and real
engines alike): what a client that trusts every event to be one vLLM could send relies on."""

from __future__ import annotations

import json
from typing import Any


def strict_events(text: str, chat: bool, usage: bool, completion_tokens: int
                  ) -> list[dict[str, Any]]:
    """Parse an SSE body as a strict client of vLLM's format: every `data:` event before
    `[DONE]` is a chunk with id, object, created, model and a non-empty choices list, but
    for the usage chunk (asked for only), which is the last one."""
    events, done = [], False
    for line in text.splitlines():
        if not line.startswith("data:"):
            assert line == "" or line.startswith(":"), line  # blank separators, comments
            continue
        assert not done, "an event after [DONE]"
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        ev = json.loads(data)
        assert ev["object"] == ("chat.completion.chunk" if chat else "text_completion"), ev
        assert {"id", "created", "model", "choices"} <= set(ev), ev
        events.append(ev)
    assert done
    empty = [i for i, ev in enumerate(events) if not ev["choices"]]
    assert empty == ([len(events) - 1] if usage else []), events
    if usage:
        assert events[-1]["usage"]["completion_tokens"] == completion_tokens
    return events
