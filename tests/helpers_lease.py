"""A real lease-control channel for transfer tests that post reuse READs: P asks D that the
lease holds before every reuse READ (`connectors.transfer.reads`), so such a test serves
a `LeaseKeeper` holding one lease over the blocks it reads."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from helpers_http import free_port

from kvferry.connectors.scheduling.lease_keeper import LeaseKeeper
from kvferry.connectors.transfer.lease_control import ControlServer

LEASE_ID = "lease-under-test"


@contextmanager
def held_lease(block_ids: Sequence[int], block_size: int = 16) -> Iterator[tuple[LeaseKeeper, int]]:
    """(keeper, control port) with lease `LEASE_ID` held over ``block_ids``."""
    keeper = LeaseKeeper("D-test", "boot-test", "127.0.0.1", 1, block_size, ttl=100.0,
                         free_grace=5.0)
    tokens = list(range(len(block_ids) * block_size))
    assert keeper.grant("req-" + LEASE_ID, {"lease_id": LEASE_ID, "ttl": 100}, list(block_ids),
                        tokens, len(tokens))
    port = free_port()
    server = ControlServer(keeper, "127.0.0.1", port)
    try:
        yield keeper, port
    finally:
        server.close()
