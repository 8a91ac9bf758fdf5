"""What the decode leg tells those who follow it (a conversation turn's commit, push's P
leg): a small observer interface, notified in order, instead of callbacks carried down.

Every method does nothing by default and an observer overrides what it cares about; the
leg wires in only what some observer overrides, so a leg nobody follows keeps the plain
pass-through path (no call per chunk is added). A `chunk_filter` rewrites the client's
SSE bytes; several run in observer order."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ..fleet.upstreams import Upstream
from ..wire.sse_filters import ChainedFilter, ChunkFilter


class DecodeObserver:
    """Told about one decode leg's answer; a method left as is costs nothing."""

    chunk_filter: ChunkFilter | None = None

    async def answered(self, data: bytes, params: dict[str, Any] | None) -> None:
        """A 200 JSON answer: its bytes and D's kv_transfer_params (None: none)."""

    def stream_params(self, params: dict[str, Any]) -> None:
        """D's kv_transfer_params, carried by its stream (never forwarded to the client)."""

    def stream_done(self) -> None:
        """D's `data: [DONE]` is about to be forwarded."""

    def ended(self, clean: bool) -> None:
        """The client's stream ended: cleanly, or not (client gone, D broke)."""

    def moved(self, d: Upstream) -> None:
        """The stream continues on D `d` (a migration)."""

    async def settle(self) -> None:
        """Awaited before a 200 JSON answer or a stream's `[DONE]` goes out."""

    async def recorded(self) -> None:
        """Awaited once a stream's `[DONE]` has passed every filter, before it goes out:
        what the turn records is then visible to the client's next turn."""

    def json_headers(self) -> dict[str, str]:
        """Extra headers for a 200 JSON answer."""
        return {}


class Observers:
    """One leg's observers, in order, as the hooks the wire layer takes: each is None when
    no observer overrides it."""

    def __init__(self, observers: list[DecodeObserver]) -> None:
        self.all = observers

    def _with(self, name: str) -> list[DecodeObserver]:
        base = getattr(DecodeObserver, name)
        return [o for o in self.all if getattr(type(o), name) is not base]

    def chunk_filter(self) -> ChunkFilter | None:
        filters = [o.chunk_filter for o in self.all if o.chunk_filter is not None]
        return None if not filters else filters[0] if len(filters) == 1 else ChainedFilter(*filters)

    def answered(self) -> Callable[[bytes, dict[str, Any] | None], Awaitable[None]] | None:
        if not (obs := self._with("answered")):
            return None

        async def call(data: bytes, params: dict[str, Any] | None) -> None:
            for o in obs:
                await o.answered(data, params)
        return call

    def stream_params(self) -> Callable[[dict[str, Any]], None] | None:
        if not (obs := self._with("stream_params")):
            return None

        def call(params: dict[str, Any]) -> None:
            for o in obs:
                o.stream_params(params)
        return call

    def stream_done(self) -> Callable[[], None] | None:
        if not (obs := self._with("stream_done")):
            return None

        def call() -> None:
            for o in obs:
                o.stream_done()
        return call

    def ended(self, clean: bool) -> Callable[[], None] | None:
        if not (obs := self._with("ended")):
            return None

        def call() -> None:
            for o in obs:
                o.ended(clean)
        return call

    def moved(self) -> Callable[[Upstream], None] | None:
        if not (obs := self._with("moved")):
            return None

        def call(d: Upstream) -> None:
            for o in obs:
                o.moved(d)
        return call

    def _awaited(self, name: str) -> Callable[[], Awaitable[None]] | None:
        """The observers' coroutine method `name`, awaited in order (None: none has one)."""
        if not (obs := self._with(name)):
            return None

        async def call() -> None:
            for o in obs:
                await getattr(o, name)()
        return call

    def settle(self) -> Callable[[], Awaitable[None]] | None:
        return self._awaited("settle")

    def recorded(self) -> Callable[[], Awaitable[None]] | None:
        return self._awaited("recorded")

    def json_headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for o in self._with("json_headers"):
            out.update(o.json_headers())
        return out
