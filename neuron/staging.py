"""Host-staged KV transfer: the fallback when Neuron HBM cannot be registered with NIXL.

Device registration needs NIXL's LIBFABRIC backend with FI_HMEM_NEURON (libfabric >= 1.21,
EFA), and mapped-HBM registration needs NEURON_RT_MAP_HBM=1. When neither works (or a
registration fails), KV can still move: we mirror every device KV array in pinned host
DRAM, register the mirrors as DRAM, copy device -> host before a peer reads (or before
we write), and host -> device after data arrived. Each copy is timed and logged, because
this path costs two PCIe crossings per transfer and operators should see that in their
logs, not guess it.

Who copies when (connectors/): D stages in after a READ completes, or when every push
WRITE landed, before reporting the request received (reads.py, push_recv.py); push P
stages out right before posting its WRITE; pull P stages out in ``wait_for_save`` the
blocks each step's forward wrote (staged_saves.py), so the mirror is current before the
offer leaves. Decode leases are never granted while staging may be active: a leased
block's mirror would miss every later decode step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvferry.connectors.memory.backends import DRAM, KVLayout, Plane, Region
from kvferry.neuron.arrays import DeviceArray, is_torch_tensor

log = logging.getLogger("vllm." + __name__)  # under vLLM's handlers in an engine

D2H = "d2h"
H2D = "h2d"

# copy(direction, array, offset_in_array, host_addr, nbytes)
CopyFn = Callable[[str, DeviceArray, int, int, int], None]


def nrt_copy(direction: str, array: DeviceArray, offset: int, host_addr: int, nbytes: int) -> None:
    """Default copy on Neuron: nrt_tensor_read (d2h) / nrt_tensor_write (h2d)."""
    from kvferry.neuron.libnrt import load

    if array.nrt_handle is None:
        raise ValueError(
            f"{array.name}: host staging needs an nrt tensor handle (NeuronArray.nrt_handle) "
            "or an injected copy function"
        )
    lib = load()
    if direction == D2H:
        lib.tensor_read(array.nrt_handle, host_addr, offset, nbytes)
    elif direction == H2D:
        lib.tensor_write(array.nrt_handle, host_addr, offset, nbytes)
    else:
        raise ValueError(f"unknown copy direction {direction!r}")


def torch_copy(direction: str, array: DeviceArray, offset: int, host_addr: int, nbytes: int) -> None:
    """Copy on a torch KV tensor (vllm-neuron's ``neuron`` device, or CPU) with the
    framework's own ``Tensor.copy_``: torch tensors carry no nrt handle, and device <-> CPU
    copies are what the community host-staging attempt used (vllm-project/vllm-neuron
    issue 26 / PR 27: KV moved through CPU DRAM, ``.cpu()``)."""
    import torch

    dev = _byte_view(array.obj)[offset:offset + nbytes]
    host = torch.frombuffer((ctypes.c_char * nbytes).from_address(host_addr), dtype=torch.uint8)
    if direction == D2H:
        host.copy_(dev)
    elif direction == H2D:
        dev.copy_(host)
    else:
        raise ValueError(f"unknown copy direction {direction!r}")


def _byte_view(t):  # noqa: ANN001, ANN202 (torch is imported lazily)
    """Bytes from ``t.data_ptr()`` on, as a flat uint8 tensor on t's device (a view)."""
    import torch

    if t.is_contiguous():
        return t.reshape(-1).view(torch.uint8)
    st = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))
    return flat[t.data_ptr() - st.data_ptr():]


def copy_problem(array: DeviceArray) -> str | None:
    """Why :func:`default_copy` cannot move this array's bytes (None: it can)."""
    if is_torch_tensor(array.obj) or array.nrt_handle is not None:
        return None
    return (f"{array.name}: no copy path (not a torch tensor, no nrt tensor handle); pass "
            "NeuronBackend(copy=...)")


def default_copy(direction: str, array: DeviceArray, offset: int, host_addr: int,
                 nbytes: int) -> None:
    """The copy each array allows: ``Tensor.copy_`` for torch tensors, nrt_tensor_read /
    nrt_tensor_write for nrt handles."""
    if is_torch_tensor(array.obj):
        torch_copy(direction, array, offset, host_addr, nbytes)
    else:
        nrt_copy(direction, array, offset, host_addr, nbytes)


class PinnedBuffer:
    """Page-aligned anonymous host memory, mlock'ed when the memlock limit allows."""

    _warned = False

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._anchor = ctypes.c_char.from_buffer(self._map)
        self.addr = ctypes.addressof(self._anchor)
        self.pinned = self._mlock()

    def _mlock(self) -> bool:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.mlock(ctypes.c_void_p(self.addr), ctypes.c_size_t(self.nbytes)) == 0:
            return True
        if not PinnedBuffer._warned:
            PinnedBuffer._warned = True
            log.warning("mlock of %d bytes failed (errno %d; raise `ulimit -l`): staging "
                        "buffers stay pageable until NIXL registers them", self.nbytes,
                        ctypes.get_errno())
        return False

    def view(self) -> memoryview:
        return memoryview(self._map)[: self.nbytes]

    def close(self) -> None:
        del self._anchor
        self._map.close()


@dataclass
class StagingStats:
    """Cumulative cost of the host path (also logged per transfer)."""

    transfers: int = 0
    bytes: int = 0
    ms: float = 0.0
    last: dict[str, float] = field(default_factory=dict)


class HostStaging:
    """Pinned host mirrors of device KV arrays, with block-granular copies both ways.

    ``device`` is the VRAM layout the backend built; ``owners[i]`` lists the device arrays
    inside region ``i``. Mirror region ``i`` has the same length as device region ``i`` and
    every plane keeps its offset, so block ``b`` sits at the same offset on both sides.
    """

    def __init__(self, device: KVLayout, owners: Sequence[Sequence[DeviceArray]],
                 copy: CopyFn | None = None) -> None:
        if len(owners) != len(device.regions):
            raise ValueError("one owner list per device region is required")
        self.device = device
        self.owners = [list(o) for o in owners]
        self.copy: CopyFn = copy or default_copy
        self.buffers = [PinnedBuffer(r.length) for r in device.regions]
        regions = tuple(Region(b.addr, r.length, 0, DRAM)
                        for b, r in zip(self.buffers, device.regions, strict=True))
        # fmt and heads carry over: a mirror must pair with a peer's device layout (mixed modes).
        planes = tuple(Plane(p.region, regions[p.region].addr + (p.base - device.regions[p.region].addr),
                             p.stride, p.block_bytes, p.num_blocks, p.fmt, p.heads)
                       for p in device.planes)
        self.layout = KVLayout(regions, planes, device.num_blocks, device.block_size)
        self.stats = StagingStats()
        # The engine thread stages out (pull, P) while the transfer thread stages in/out
        # (D, push): the copies touch disjoint blocks, only the counters are shared.
        self._stats_lock = threading.Lock()

    # -- copies ---------------------------------------------------------------------
    def stage_out(self, block_ids: Iterable[int] | None = None) -> tuple[int, float]:
        """Device -> host for these blocks (all if None), before a peer reads our mirror."""
        return self._run(D2H, block_ids)

    def stage_in(self, block_ids: Iterable[int] | None = None) -> tuple[int, float]:
        """Host -> device for these blocks (all if None), after a peer wrote our mirror."""
        return self._run(H2D, block_ids)

    def _run(self, direction: str, block_ids: Iterable[int] | None) -> tuple[int, float]:
        runs = _runs(range(self.device.num_blocks) if block_ids is None else block_ids)
        t0 = time.perf_counter()
        total = 0
        for dp, hp in zip(self.device.planes, self.layout.planes, strict=True):
            dense = dp.stride == dp.block_bytes
            for start, count in runs:
                pieces = [(start, count)] if dense else [(b, 1) for b in range(start, start + count)]
                for b, n in pieces:
                    nbytes = (n - 1) * dp.stride + dp.block_bytes
                    dev_addr = dp.block_addr(b)
                    owner = self._owner(dp.region, dev_addr, nbytes)
                    self.copy(direction, owner, dev_addr - owner.va, hp.block_addr(b), nbytes)
                    total += nbytes
        ms = (time.perf_counter() - t0) * 1e3
        with self._stats_lock:
            self.stats.transfers += 1
            self.stats.bytes += total
            self.stats.ms += ms
            self.stats.last = {"bytes": total, "ms": ms}
        gbps = total / ms / 1e6 if ms > 0 else float("inf")
        log.info("neuron host staging %s: %d bytes, %d block runs, %.3f ms (%.2f GB/s)",
                 direction, total, len(runs), ms, gbps)
        return total, ms

    def _owner(self, region: int, addr: int, nbytes: int) -> DeviceArray:
        for a in self.owners[region]:
            if a.va <= addr and addr + nbytes <= a.end:
                return a
        raise ValueError(f"no single device array covers [{addr:#x}, +{nbytes}) in region {region}")

    def close(self) -> None:
        for b in self.buffers:
            b.close()
        self.buffers = []


def _runs(block_ids: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted, de-duplicated block ids as (start, count) runs, so copies are few and large."""
    out: list[tuple[int, int]] = []
    for b in sorted(set(block_ids)):
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out
