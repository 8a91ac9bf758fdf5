"""A streamed answer's body chunks written straight to the client's connection.

Each chunk that goes through ASGI's `send` wakes the pump task and runs the server's
send coroutine: most of the router's Python time per streamed token. uvicorn's httptools
server (the router's, `uvicorn[standard]`) keeps its connection on the `send` it hands
the app (`RequestResponseCycle.transport`, `.flow`, `.chunked_encoding`, as of uvicorn
0.55); with it a chunk is framed and written the way that `send` would, from the upstream
reader's callback (`sse.UpstreamStream`). Any other server, or a uvicorn without those
attributes, gets every chunk through `send`.
"""

from __future__ import annotations

from typing import Any

from starlette.types import Send

_CYCLE = ("uvicorn.protocols.http.httptools_impl", "RequestResponseCycle")
_ATTRS = ("transport", "flow", "disconnected", "chunked_encoding", "response_started",
          "response_complete")


class DirectBody:
    """Writes body chunks of a started chunked response as uvicorn's `send` frames them.

    `ready()` first: False once the client went away, the response ended, or the
    client's socket buffer is over its high-water mark (uvicorn's flow control paused
    writing: the chunk then goes through `send`, which waits for the client)."""

    __slots__ = ("_cycle", "_flow", "_write")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self._flow = cycle.flow
        self._write = cycle.transport.write

    def ready(self) -> bool:
        c = self._cycle
        return not (c.disconnected or c.response_complete or self._flow.write_paused)

    def __call__(self, data: bytes) -> None:
        self._write(b"%x\r\n%b\r\n" % (len(data), data))


def direct_body(send: Send) -> DirectBody | None:
    """The direct writer for `send`'s response (its start already sent), or None."""
    cycle = getattr(send, "__self__", None)
    kind = type(cycle)
    if (kind.__module__, kind.__name__) != _CYCLE or not all(hasattr(cycle, a) for a in _ATTRS):
        return None
    if not cycle.response_started or cycle.chunked_encoding is not True:
        return None
    return DirectBody(cycle)
