"""What the push protocol tests share (tests/test_push_*.py): a P-side matcher and a
D-side receiver with short, fixed timeouts, and destinations of BS-token blocks."""

from __future__ import annotations

from kvferry.connectors.protocol.push_match import Destination, PushMatcher
from kvferry.connectors.protocol.push_receive import PushReceiver

BS = 16


def dest(ids=((10, 11, 12),), block_size=BS, num_blocks=100, first_token=0) -> Destination:
    return Destination(ids, block_size, num_blocks, first_token)


def kinds(actions) -> list[str]:
    return [type(a).__name__ for a in actions]


def m(**kw) -> PushMatcher:
    return PushMatcher(BS, 100, hold_timeout=10.0, register_timeout=20.0,
                       tombstone_ttl=100.0, **kw)


def rx(**kw) -> PushReceiver:
    return PushReceiver(recv_timeout=10.0, quarantine=5.0, tombstone_ttl=100.0, **kw)
