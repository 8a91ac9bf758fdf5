"""Block checksums: one integer per KV block, computed where the KV lives.

A transfer's reader (D after a pull READ, P after a reuse READ) compares the checksums
of the blocks it received with the source's checksums of the blocks it read
(transfer/verify.py); a mismatch means recompute, never a wrong answer. Both sides run
the same reduction over the same planes in the same order (the layouts' signatures
matched at the handshake), so equal bytes give equal numbers.

The checksum of block ``b``: over every plane ``i`` of the layout, ``(i + 1)`` times the
sum of the block's 32-bit words, in wrapping int64. Any one changed byte changes it, and
so does a block landing in another block's place (checksums are per block, compared in
order) or a plane swapped with another; it is no cryptographic hash: it detects
corruption, not an adversary who can write KV (who could write any answer anyway).

Memory is reached from the layout's integers, as NIXL reaches it: DRAM regions through
their address (CPU engines, Neuron host mirrors), VRAM regions through CUDA's array
interface (a torch tensor on the region's device, the reduction runs there). Neuron HBM
registered as VRAM has no host-side view: `BlockSums.available` is False and transfers
from or to it are not checked (counted as such by the reader).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

from kvferry.connectors.memory.backends import DRAM, VRAM, KVLayout, Plane


class _CudaRegion:
    """A VRAM range as CUDA's array interface describes it (what torch.as_tensor reads)."""

    def __init__(self, addr: int, length: int) -> None:
        self.__cuda_array_interface__ = {"shape": (length,), "typestr": "|u1",
                                         "data": (addr, False), "version": 3}


def _region_tensor(addr: int, length: int, mem_type: str, device_id: int) -> Any:
    import torch

    if mem_type == DRAM:
        return torch.frombuffer((ctypes.c_uint8 * length).from_address(addr), dtype=torch.uint8)
    if mem_type == VRAM and torch.cuda.is_available():
        return torch.as_tensor(_CudaRegion(addr, length), device=f"cuda:{device_id}")
    raise NotImplementedError(f"no host-side view of {mem_type} memory here")


class BlockSums:
    """Checksums of blocks of one engine rank's layout (module docstring)."""

    def __init__(self, layout: KVLayout | None) -> None:
        """Views are made at first use (the transfer thread's first check), not at start."""
        self.layout = layout
        self._planes: list[Any] | None = None  # per plane: (num_blocks, block words) int32
        self._why_not = "" if layout is not None else "no KV layout"
        self._lock = threading.Lock()  # the transfer and side-channel threads both use it

    def _views(self) -> list[Any]:
        with self._lock:
            if self._planes is None:
                self._planes = self._make_views()
            return self._planes

    def _make_views(self) -> list[Any]:
        if self.layout is None:
            return []
        layout = self.layout
        try:
            regions = [_region_tensor(r.addr, r.length, r.mem_type, r.device_id)
                       for r in layout.regions]
            return [self._blocks(regions[p.region], layout.regions[p.region].addr, p)
                    for p in layout.planes]
        except (NotImplementedError, ValueError, RuntimeError, ImportError) as e:
            self._why_not = str(e) or type(e).__name__
            return []

    @property
    def why_not(self) -> str:
        """Why checksums are unavailable here ("" when they are)."""
        self._views()
        return self._why_not

    @staticmethod
    def _blocks(region: Any, region_addr: int, p: Plane) -> Any:
        import torch

        off = p.base - region_addr
        if off % 4 or p.stride % 4 or p.block_bytes % 4 or region_addr % 4:
            raise ValueError("KV blocks not aligned to 32-bit words")
        words = region[: region.numel() // 4 * 4].view(torch.int32)
        return words.as_strided((p.num_blocks, p.block_bytes // 4), (p.stride // 4, 1), off // 4)

    @property
    def available(self) -> bool:
        return bool(self._views())

    def sums(self, block_ids: Sequence[int]) -> list[int]:
        """One checksum per block, in ``block_ids``' order. IndexError for a block id
        outside the cache (a peer's request is checked like an offer)."""
        import torch

        planes = self._views()
        if not planes or self.layout is None:
            raise RuntimeError(f"block checksums unavailable: {self.why_not}")
        n = self.layout.num_blocks
        bad = [b for b in block_ids if not 0 <= b < n]
        if bad:
            raise IndexError(f"block ids {bad[:4]} outside [0, {n})")
        if not block_ids:
            return []
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=planes[0].device)
        acc = torch.zeros(len(block_ids), dtype=torch.int64, device=idx.device)
        for i, plane in enumerate(planes):
            acc += (i + 1) * plane.index_select(0, idx).sum(dim=1, dtype=torch.int64)
        return [int(v) for v in acc.tolist()]

    def flip_byte(self, block_id: int) -> None:
        """Chaos only (transfer/faults.py's ``corrupt``): change one byte of a block's
        first plane, as a transfer that delivered a wrong byte would."""
        row = self._views()[0][block_id]
        row[len(row) // 2] ^= 0x01000000  # one bit of one byte, mid-block
