"""When no D will read P's offer (D refused or failed the request, or the router refused
it after P answered), tell P to free the offer's blocks now: otherwise P keeps them for
``send_timeout_s`` (pull, 120 s) or ``push_hold_timeout_s`` (push, 30 s), and a burst of
such requests pins P's whole KV cache.

The message is connectors/protocol/send_release.py, sent to each of P's ranks; P's side
is connectors/transfer/handshake.py. Runs in the background: the client's answer never
waits for it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvferry.connectors.protocol import send_release

from .context import FlowContext

log = logging.getLogger(__name__)

TIMEOUT_S = 2.0


async def _tell_rank(host: str, port: int, blob: bytes) -> str:
    """One rank's answer: "ok", or why not."""
    sock = zmq.asyncio.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        await sock.send(blob)
        if not await sock.poll(int(TIMEOUT_S * 1000)):
            return "unreachable"
        reply = msgspec.msgpack.decode(await sock.recv())
    except (zmq.ZMQError, msgspec.DecodeError) as e:
        log.debug("release of a send on %s:%d failed: %s", host, port, e)
        return "unreachable"
    finally:
        sock.close()
    if isinstance(reply, dict) and reply.get("ok") is True:
        return "ok"
    return str(reply.get("error", "bad_reply")) if isinstance(reply, dict) else "bad_reply"


async def release(ctx: FlowContext, offer: Any, key: bytes | None) -> None:
    """Tell P's ranks to free ``offer``'s blocks; counted by result, never raises."""
    where = send_release.releasable(offer)
    if where is None:
        return
    host, port, tp, req_id = where
    blob = send_release.request(req_id, key)
    results = await asyncio.gather(*(_tell_rank(host, port + r, blob) for r in range(tp)))
    for result in results:
        ctx.metrics.offers_released.labels(result=result).inc()


def release_soon(ctx: FlowContext, offer: Any) -> None:
    """`release` as a background task of the app (cancelled at shutdown)."""
    if send_release.releasable(offer) is None:
        return
    _background(ctx, release(ctx, offer, ctx.secret))


async def abort_push(ctx: FlowContext, host: str, port: int, transfer_id: str) -> None:
    """Push: tell P's ranks that no D will register for ``transfer_id`` (D refused or
    failed the leg): P frees what it prefilled for it now, not after push_hold_timeout_s."""
    blob = send_release.request("", ctx.secret, transfer_id)
    tp = ctx.settings.prefill_tp_size
    for result in await asyncio.gather(*(_tell_rank(host, port + r, blob) for r in range(tp))):
        ctx.metrics.offers_released.labels(result=result).inc()


def abort_push_soon(ctx: FlowContext, prefill_url: str, transfer_id: str) -> None:
    """`abort_push` in the background, for the P at ``prefill_url``."""
    addr = ctx.settings.prefill_kv_addr(prefill_url)
    if addr is not None:
        _background(ctx, abort_push(ctx, *addr, transfer_id))


def _background(ctx: FlowContext, coro: Any) -> None:
    task = asyncio.create_task(coro)
    ctx.background.add(task)
    task.add_done_callback(ctx.background.discard)
