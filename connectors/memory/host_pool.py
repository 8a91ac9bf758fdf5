"""D's host tier memory (issue 34): block-sized slots in one DRAM region, laid out like
the rank's KV cache, so a lease's blocks move to host and back, and P READs them, with
the descriptors HBM blocks use (transfer/layout.py).

The pool is a `KVLayout` of its own: for every plane of the cache a dense array of
``num_slots`` blocks with the same block bytes, memory order and head axis, so
``check_compatible`` holds and a slot id is used where a block id would be. The copies
are NIXL transfers between the rank's own agent and itself (`Transport.add_pool`): one
code path for cuda (VRAM to pinned DRAM) and cpu (DRAM to DRAM). Which slot holds what
is connectors/protocol/host_tier.py's business, not this module's.

Not wired into the connector yet: nothing spills a lease today (docs/kv-tiers.md).
"""

from __future__ import annotations

from .backends import DRAM, KVLayout, Plane, Region


def slot_bytes(kv: KVLayout) -> int:
    """Host bytes one block takes in the pool (every plane's block)."""
    return sum(p.block_bytes for p in kv.planes)


def pool_layout(kv: KVLayout, num_slots: int, base: int) -> KVLayout:
    """The pool at ``base`` (``num_slots * slot_bytes(kv)`` bytes of DRAM): plane after
    plane, each a dense array of ``num_slots`` blocks shaped like the cache plane's."""
    if num_slots <= 0:
        raise ValueError(f"a host pool needs at least one slot, not {num_slots}")
    planes, off = [], 0
    for p in kv.planes:
        planes.append(Plane(0, base + off, p.block_bytes, p.block_bytes, num_slots, p.fmt,
                            p.heads))
        off += p.block_bytes * num_slots
    return KVLayout((Region(base, off, 0, DRAM),), tuple(planes), num_slots, kv.block_size)


class HostPool:
    """The pool's memory, owned (freed with the object), and its layout. ``pin``: page-
    locked memory, which CUDA copies need to run asynchronously (torch's pin_memory)."""

    def __init__(self, kv: KVLayout, num_slots: int, pin: bool = False) -> None:
        import torch  # the engine has it; importing this module alone must not need it

        self.num_slots = num_slots
        self.nbytes = num_slots * slot_bytes(kv)
        self.buffer = torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        self.layout = pool_layout(kv, num_slots, self.buffer.data_ptr())
