"""What may rewrite a streamed answer on its way to the client: the engine-field filter
(every event), the insertion before `[DONE]` (push: P's report), and a chain of them.
Each sees raw SSE bytes and returns the bytes to send; only events that carry an
engine field are parsed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Protocol

from . import bodies
from .sse_framing import event_ends, last_event_end


class ChunkFilter(Protocol):
    """Rewrites the byte stream on its way to the client (may hold bytes back)."""

    def feed(self, chunk: bytes) -> bytes: ...

    def flush(self) -> bytes: ...


DONE_EVENT = b"data: [DONE]"
DONE = b"[DONE]"


class InsertBeforeDone:
    """Inserts `extra()` (when it returns bytes) just before the `data: [DONE]` event.

    Chunk boundaries are arbitrary, so a chunk tail that could be the start of the
    marker is held back until the next chunk (vLLM's chunks end with a blank line, so in
    practice nothing is delayed).
    """

    def __init__(self, extra: Callable[[], bytes | None]) -> None:
        self._extra = extra
        self._held = b""
        self._done = False

    def feed(self, chunk: bytes) -> bytes:
        data, self._held = self._held + chunk, b""
        if self._done:
            return data
        start = 0
        while (i := data.find(DONE_EVENT, start)) >= 0:
            if i == 0 or data[i - 1 : i] == b"\n":
                self._done = True
                return data[:i] + (self._extra() or b"") + data[i:]
            start = i + 1
        for k in range(min(len(DONE_EVENT) - 1, len(data)), 0, -1):
            if DONE_EVENT.startswith(data[-k:]):
                self._held = data[-k:]
                return data[:-k]
        return data

    def flush(self) -> bytes:
        out, self._held = self._held, b""
        return out


_MARKERS = tuple(f'"{k}"'.encode() for k in bodies.ENGINE_FIELDS)
_MARKER = re.compile(b"|".join(re.escape(m) for m in _MARKERS))
"""Any engine-owned field's key."""
_TAIL = os.path.commonprefix([m[::-1] for m in _MARKERS])[::-1]
"""The end every engine field's key shares (`_transfer_params"`): absent, no key is there,
found by one substring search (the regex's alternation scans slower) on the token path."""


class EngineFieldFilter:
    """Removes engine-owned fields (`bodies.ENGINE_FIELDS`) from every SSE event.

    vLLM 0.33 puts D's `kv_transfer_params` (block ids, host:port, a lease) on the last
    streamed chunk; passed through, a client would see engine internals. Events are
    forwarded whole: bytes after the last complete event wait for the rest of it (vLLM
    ends each chunk with an event, so nothing waits in practice). Events that mention no
    engine field are forwarded untouched, without parsing. `on_params` receives the first
    non-empty `kv_transfer_params` seen (D's lease offer, for the conversation registry);
    `on_done` is called once, just before the `data: [DONE]` event is passed on.
    """

    def __init__(self, on_params: Callable[[dict], None] | None = None,
                 on_done: Callable[[], None] | None = None) -> None:
        self._on_params = on_params
        self._on_done = on_done
        self._held = b""
        self.scrubbed = 0
        """Events from which a field was removed (a counter tests and metrics read)."""

    def passes(self, event: bytes) -> bool:
        """`feed` would return this one whole JSON event (not `[DONE]`) as it is: a filter
        before this one that vouches for the event's shape skips `feed` (`EventRewriter`)."""
        return not self._held and _TAIL not in event

    def feed(self, chunk: bytes) -> bytes:
        if not self._held and chunk.endswith(b"\n\n") and (
                _TAIL not in chunk if _TAIL else _MARKER.search(chunk) is None):
            return self._done(chunk) if DONE in chunk else chunk  # whole events, none to scrub
        data = self._held + chunk
        end = last_event_end(data)
        self._held = data[end:]
        return self._done(self._scrub(data[:end]))

    def flush(self) -> bytes:
        out, self._held = self._held, b""
        return self._done(self._scrub(out))

    def _done(self, data: bytes) -> bytes:
        if self._on_done is not None and DONE_EVENT in data:
            done, self._on_done = self._on_done, None
            done()
        return data

    def _scrub(self, data: bytes) -> bytes:
        if not any(m in data for m in _MARKERS):
            return data
        out = []
        pos = 0
        for start, end in event_ends(data):
            out.append(self._event(data[pos:start]) + data[start:end])
            pos = end
        if pos < len(data):
            out.append(self._event(data[pos:]))
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        """One SSE event (lines without the blank line ending it), engine fields removed."""
        if not any(m in event for m in _MARKERS):
            return event
        lines = event.splitlines()
        data_lines = [ln[5:].removeprefix(b" ") for ln in lines if ln.startswith(b"data:")]
        try:
            obj = bodies.decode(b"\n".join(data_lines))  # msgspec, as vLLM writes it back
        except ValueError:
            return event  # not JSON: no object field to remove
        removed = bodies.scrub_engine_fields(obj)
        if not removed:
            return event
        self.scrubbed += 1
        params = removed.get("kv_transfer_params")
        if isinstance(params, dict) and params and self._on_params is not None:
            self._on_params(params)
            self._on_params = None
        other = [ln for ln in lines if not ln.startswith(b"data:")]
        return b"\n".join([*other, b"data: " + bodies.encode(obj)])


class ChainedFilter:
    """Applies several ChunkFilters in order."""

    def __init__(self, *filters: ChunkFilter) -> None:
        self.filters = filters

    def feed(self, chunk: bytes) -> bytes:
        for f in self.filters:
            chunk = f.feed(chunk)
        return chunk

    def flush(self) -> bytes:
        out = b""
        for f in self.filters:
            out = f.feed(out) + f.flush() if out else f.flush()
        return out
