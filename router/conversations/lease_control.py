"""The router's end of D's lease-control channel: one signed request (renew, release,
info) over ZMQ REQ, from the asyncio loop. The messages are
connectors/protocol/lease_control.py; D serves them in connectors/transfer/lease_control.py.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from kvferry.connectors.protocol import lease_control as wire

fault_hook: Callable[[], Awaitable[bool]] | None = None
"""Set only in a chaos run's router (`kvferry.scripts.cli.wire_router_faults`): awaited
before each call, True loses the call (the fault plan's ``lease_call`` point)."""


async def call(addr: tuple[str, int], op: str, lease_id: str, ttl: float | None = None,
               timeout_s: float = 2.0, key: bytes | None = None) -> dict[str, Any]:
    """One request to D's channel at ``addr`` (host, port); ``{"ok": False, "error":
    "unreachable..."}`` when D does not answer within ``timeout_s``."""
    host, port = addr
    if fault_hook is not None and await fault_hook():
        return wire.unreachable()
    sock = zmq.asyncio.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        await sock.send(wire.request(op, lease_id, ttl, key))
        if not await sock.poll(int(timeout_s * 1000)):
            return wire.unreachable()
        return wire.reply(await sock.recv())
    except zmq.ZMQError as e:
        return wire.unreachable(str(e))
    finally:
        sock.close()
