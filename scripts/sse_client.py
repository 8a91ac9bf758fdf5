"""Reading an OpenAI-style SSE answer as a client (`kvferry demo`, the chaos run's traffic).

``data: {json}`` events up to ``data: [DONE]``; an in-band ``{"error": ...}`` event (what
the router sends when a leg breaks after the stream started), an event that is not a JSON
object, and a stream that ends without ``[DONE]`` are `StreamError`s, each with its kind.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any, Literal

Kind = Literal["error", "malformed", "truncated"]


class StreamError(RuntimeError):
    """The stream did not end with ``[DONE]`` after well-formed events."""

    def __init__(self, kind: Kind, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


def events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """Each JSON event of the stream's ``lines`` in order, until ``data: [DONE]`` (the
    lines after it are not read); `StreamError` instead of a bad or missing end."""
    for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, comments, event names
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError:
            raise StreamError("malformed", data[:200]) from None
        if not isinstance(event, dict):
            raise StreamError("malformed", data[:200])
        if "error" in event:
            raise StreamError("error", str(event["error"])[:200])
        yield event
    raise StreamError("truncated", "the stream ended without [DONE]")
