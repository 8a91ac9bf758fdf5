"""The router's subscription to each prefill engine's KV cache events, and the prefill
choice it informs.

Each P runs with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:PORT"}'``; the router is given ``tcp://P-host:PORT`` per P
(`RouterSettings.prefill_kv_events`, aligned with the prefill URLs) and SUBscribes. vLLM's
wire format (vllm/distributed/kv_events.py, 0.32): multipart ``(topic, seq: 8 bytes big
endian, payload)``, payload the msgpack of ``[ts, [event, ...], dp_rank]``, each event a
map tagged ``"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"``. A sequence
number lower than the last one seen means the engine restarted (its cache is empty): its
index is cleared. Gaps (events the PUB socket dropped) are counted; the index's LRU bound
ages out what they leave behind.

The prefill choice it informs is `legs.prefill.choose_prefill`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from ..metrics import RouterMetrics
from ..wire import bodies
from .kv_index import PrefixIndex

log = logging.getLogger(__name__)

RECONNECT_CHECK_S = 2.0


def decode_batch(payload: bytes) -> list[Any] | None:
    """The events of one published batch, or None when it is not one."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError):
        return None
    if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], list):
        return None
    return batch[1]


class KvEventSubscriber:
    """One SUB socket per P endpoint; batches are applied to `index` as they arrive."""

    def __init__(self, index: PrefixIndex, metrics: RouterMetrics,
                 names: Mapping[str, str]) -> None:
        self.index = index
        self.metrics = metrics
        self._names = names  # P URL -> its name in metrics (never its address)
        self._last_seq: dict[str, int] = {}
        self._ctx = zmq.asyncio.Context()

    def handle(self, url: str, frames: list[bytes]) -> None:
        """One received message from the P at `url`."""
        name = self._names[url]
        if len(frames) != 3 or len(frames[1]) != 8:
            self.metrics.kv_events.labels(prefill=name, result="malformed").inc()
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        last = self._last_seq.get(url)
        if last is not None and seq <= last:
            self.index.engine(url).cleared()  # the engine restarted: its cache is empty
        elif last is not None and seq > last + 1:
            self.metrics.kv_events.labels(prefill=name, result="gap").inc(seq - last - 1)
        self._last_seq[url] = seq
        events = decode_batch(frames[2])
        if events is None:
            self.metrics.kv_events.labels(prefill=name, result="malformed").inc()
            return
        self.index.apply(url, events)
        self.metrics.kv_events.labels(prefill=name, result="ok").inc(len(events))
        self.metrics.kv_index_blocks.labels(prefill=name).set(len(self.index.engine(url)))

    async def run(self, endpoints: Mapping[str, str]) -> None:
        """Receive until cancelled. `endpoints`: P URL -> ``tcp://host:port``."""
        socks: dict[zmq.asyncio.Socket, str] = {}
        try:
            for url, ep in endpoints.items():
                s = self._ctx.socket(zmq.SUB)
                s.setsockopt(zmq.SUBSCRIBE, b"")
                s.setsockopt(zmq.LINGER, 0)
                s.connect(ep)
                socks[s] = url
            poller = zmq.asyncio.Poller()
            for s in socks:
                poller.register(s, zmq.POLLIN)
            while True:
                ready = await poller.poll(timeout=RECONNECT_CHECK_S * 1000)
                for s, _ in ready:
                    while True:
                        try:
                            frames = await s.recv_multipart(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.handle(socks[s], frames)
        finally:
            for s in socks:
                with contextlib.suppress(zmq.ZMQError):
                    s.close(linger=0)

    def close(self) -> None:
        self._ctx.term()


def prompt_tokens(body: Mapping[str, Any]) -> list[int] | None:
    return bodies.token_ids(body.get("prompt"))


async def subscribe(ctx_index: PrefixIndex, metrics: RouterMetrics,
                    endpoints: Mapping[str, str], names: Mapping[str, str]) -> None:
    """The app's subscription loop (started in its lifespan when endpoints are given)."""
    sub = KvEventSubscriber(ctx_index, metrics, names)
    try:
        await sub.run(endpoints)
    except asyncio.CancelledError:
        raise
    finally:
        sub.close()
