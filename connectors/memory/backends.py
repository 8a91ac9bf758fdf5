"""Memory backends: turn an engine's KV caches into regions NIXL can register.

The connectors never look at tensors directly. A backend describes the KV caches as
`Region`s (what to register: address, length, device, NIXL memory type) and `Plane`s
(where block ``b`` of one paged array lives: ``base + b * stride``). Everything above
(layout merging, transport) works on integers only, so a Neuron region built from a
device virtual address looks exactly like a CUDA or DRAM one.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

DRAM = "DRAM"
VRAM = "VRAM"


@dataclass(frozen=True)
class Region:
    """A contiguous memory range registered with NIXL once, at engine start."""

    addr: int
    length: int
    device_id: int
    mem_type: str  # DRAM | VRAM (NIXL has no Neuron type: Neuron HBM is VRAM)


@dataclass(frozen=True)
class Plane:
    """One paged array: block ``b`` occupies ``[base + b*stride, +block_bytes)``.

    A per-layer cache shaped (2, num_blocks, ...) gives two planes (K and V);
    (num_blocks, 2, ...) gives one plane whose block holds both.
    """

    region: int  # index into KVLayout.regions
    base: int
    stride: int
    block_bytes: int
    num_blocks: int
    fmt: str = ""  # inner dims and their memory order: peers must match, not just byte counts
    # Where the KV heads sit inside a block, as tp_map.HeadAxis (outer, num_heads,
    # head_bytes); (0, 0, 0) when unknown. Peers with different TP sizes copy head
    # segments by it instead of whole blocks.
    heads: tuple[int, int, int] = (0, 0, 0)

    def block_addr(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} outside [0, {self.num_blocks})")
        return self.base + block_id * self.stride


@dataclass(frozen=True)
class KVLayout:
    """All planes of one engine rank, in a fixed order both peers agree on."""

    regions: tuple[Region, ...]
    planes: tuple[Plane, ...]
    num_blocks: int
    block_size: int  # tokens per block
    # Plane indices of each model layer, in layer order (KV cache dict order); empty when
    # unknown or when one plane holds every layer (cross-layer blocks). Local only, not
    # on the wire: layer-wise push posts one layer's planes as soon as it is computed.
    layers: tuple[tuple[int, ...], ...] = field(default=(), compare=False)

    def signature(self) -> tuple[int, tuple[tuple[int, str], ...]]:
        """What two peers must share for a block-for-block copy."""
        return self.block_size, tuple((p.block_bytes, p.fmt) for p in self.planes)

    @property
    def num_heads(self) -> int:
        """KV heads of this rank in each block (0: unknown)."""
        return self.planes[0].heads[1] if self.planes else 0

    def head_signature(self) -> tuple[int, tuple[tuple[int, int], ...]] | None:
        """What two peers of different TP sizes must share to copy head segments: every
        dim of a block but the heads (None when the heads are not located)."""
        if not self.planes or any(p.heads[1] <= 0 for p in self.planes):
            return None
        return self.block_size, tuple((p.heads[0], p.heads[2]) for p in self.planes)

    def to_wire(self) -> dict[str, Any]:
        return {
            "regions": [[r.addr, r.length, r.device_id, r.mem_type] for r in self.regions],
            "planes": [[p.region, p.base, p.stride, p.block_bytes, p.num_blocks, p.fmt,
                        list(p.heads)] for p in self.planes],
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> KVLayout:
        return cls(
            regions=tuple(Region(int(a), int(n), int(dev), str(t)) for a, n, dev, t in d["regions"]),
            planes=tuple(Plane(*map(int, p[:5]), *(str(x) for x in p[5:6]),
                               *(tuple(int(v) for v in h) for h in p[6:7])) for p in d["planes"]),
            num_blocks=int(d["num_blocks"]),
            block_size=int(d["block_size"]),
        )


def planes_of_array(
    region: int,
    base: int,
    shape: Sequence[int],
    strides_bytes: Sequence[int],
    elem_bytes: int,
    block_dim: int,
    heads_dim: int | None = None,
) -> list[Plane]:
    """Planes of one strided array whose dimension ``block_dim`` indexes blocks.

    Dimensions before ``block_dim`` (e.g. the K/V axis) become separate planes; the
    dimensions after it must be dense so one block is one contiguous byte range.
    ``heads_dim`` (a dim after ``block_dim``) locates the KV heads inside a block.
    """
    inner = shape[block_dim + 1:]
    block_bytes = math.prod(inner) * elem_bytes
    expect = elem_bytes
    # Inner dims may be permuted in memory (vLLM's HND/NHD stride orders): a block is one
    # byte range iff the inner dims, taken by increasing stride, are densely packed.
    for size, st in sorted(zip(inner, strides_bytes[block_dim + 1:], strict=True), key=lambda x: x[1]):
        if size != 1 and st != expect:
            raise ValueError(
                f"KV block is not contiguous (shape {tuple(shape)}, strides {tuple(strides_bytes)})"
            )
        expect *= size
    order = sorted(range(len(inner)), key=lambda i: -strides_bytes[block_dim + 1 + i])
    fmt = "x".join(map(str, inner)) + "/" + "".join(map(str, order))
    heads = (0, 0, 0)
    if heads_dim is not None and heads_dim > block_dim:
        from kvferry.connectors.protocol.tp_map import HeadAxis

        axis = HeadAxis.of(tuple(inner[i] for i in order), order.index(heads_dim - block_dim - 1),
                           elem_bytes)
        heads = (axis.outer, axis.num_heads, axis.head_bytes)
    outer = shape[:block_dim]
    planes = []
    for idx in _ndindex(outer):
        off = sum(i * s for i, s in zip(idx, strides_bytes[:block_dim], strict=True))
        planes.append(Plane(region, base + off, strides_bytes[block_dim], block_bytes,
                            shape[block_dim], fmt, heads))
    return planes


def _ndindex(shape: Sequence[int]):
    if not shape:
        yield ()
        return
    for i in range(shape[0]):
        for rest in _ndindex(shape[1:]):
            yield (i, *rest)


class MemoryBackend(ABC):
    """Where KV blocks live and how NIXL reaches them.

    What a backend can do is declared here, never probed: ``supports_fence`` (`fence`
    marks a forward's end, so early push may start), ``may_stage`` (KV may move through
    host mirrors: P stages saves, D grants no leases), ``staging`` (after
    `register_with`, the host staging in use, or None), `configure` and
    `transport_backends`.
    """

    name: str
    mem_type: str
    default_nixl_backends: tuple[str, ...]
    supports_fence: bool = False
    may_stage: bool = False
    staging: Any = None  # kvferry.neuron.staging.HostStaging when host-staged

    @abstractmethod
    def describe(self, kv_caches: Mapping[str, Any], num_blocks: int, block_size: int,
                 heads_dim: int | None = None) -> KVLayout:
        """Regions and planes of this rank's KV caches (layer order = dict order).
        ``heads_dim``: the KV-heads dim of every tensor's (logical) shape, when known."""

    def configure(self, extra_config: Mapping[str, Any]) -> MemoryBackend:
        """Apply the engine's kv_connector_extra_config before `describe` (neuron: its
        registration mode); most backends have nothing to configure."""
        return self

    def transport_backends(self) -> tuple[str, ...]:
        """The NIXL backends the registration needs (once `register_with` chose one)."""
        return self.default_nixl_backends

    def kv_heads_dim(self, kv_caches: Mapping[str, Any]) -> int | None:
        """The KV-heads dim of these tensors when the backend knows its engine's layout
        (None: ask vLLM, `compat.kv_heads_dim`)."""
        return None

    def register_with(self, layout: KVLayout, make: Callable[[KVLayout], T]) -> T:
        """Register ``layout`` by calling ``make`` (it builds the transport). A backend
        with other ways to expose the same KV (neuron) retries with the next when NIXL
        refuses one; torch backends have one way."""
        return make(layout)

    def fence(self) -> Any:
        """Called right after the engine enqueued a forward: an object whose ``query()``
        turns True once that forward's KV writes are complete, or None when they already
        are (a synchronous device). Only backends with ``supports_fence``."""
        raise NotImplementedError(f"{self.name}: no forward fence")


class TorchMemoryBackend(MemoryBackend):
    """KV caches that are torch tensors whose data_ptr() is the real address (CPU, CUDA):
    moved by NIXL's UCX backend, each forward's completion observable (`fence`)."""

    default_nixl_backends = ("UCX",)
    supports_fence = True

    def describe(self, kv_caches: Mapping[str, Any], num_blocks: int, block_size: int,
                 heads_dim: int | None = None) -> KVLayout:
        regions: list[Region] = []
        region_of: dict[int, int] = {}
        planes: list[Plane] = []
        layers: list[tuple[int, ...]] = []
        for name, t in kv_caches.items():
            self._check_device(name, t)
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in region_of:
                region_of[key] = len(regions)
                regions.append(Region(key, storage.nbytes(), self._device_id(t), self.mem_type))
            # Walk dims in memory order (largest stride first): a cross-layer cache
            # (num_layers, num_blocks, ...) stored block-major becomes ONE plane whose block
            # holds every layer, so a run of blocks is one descriptor instead of one per layer.
            es = t.element_size()
            order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
            shape = [t.shape[d] for d in order]
            strides = [t.stride(d) * es for d in order]
            dims = [i for i, n in enumerate(shape) if n == num_blocks]
            if not dims:
                raise ValueError(f"{name}: no dimension of size num_blocks={num_blocks} in {tuple(t.shape)}")
            if num_blocks == 2 and len(dims) > 1:
                raise ValueError(f"{name}: block dimension ambiguous in {tuple(t.shape)} "
                                 f"(num_blocks={num_blocks} equals the K/V axis)")
            hd = order.index(heads_dim) if heads_dim is not None else None
            first = len(planes)
            planes += planes_of_array(region_of[key], t.data_ptr(), shape, strides, es, dims[0], hd)
            layers.append(tuple(range(first, len(planes))))
        return KVLayout(tuple(regions), tuple(planes), num_blocks, block_size,
                        tuple(layers) if len(layers) > 1 else ())

    def _check_device(self, name: str, t: Any) -> None:
        want = "cpu" if self.mem_type == DRAM else "cuda"
        if t.device.type != want:
            raise ValueError(f"{self.name} backend got {name} on {t.device}")

    def _device_id(self, t: Any) -> int:
        return 0 if t.device.type == "cpu" else int(t.device.index or 0)


class CpuBackend(TorchMemoryBackend):
    """KV in host DRAM (vLLM's CPU engines)."""

    name = "cpu"
    mem_type = DRAM

    def fence(self) -> None:
        return None  # the CPU forward has returned: its KV is written


class CudaBackend(TorchMemoryBackend):
    """KV in CUDA device memory, fenced by a CUDA event behind each forward."""

    name = "cuda"
    mem_type = VRAM

    def fence(self) -> Any:
        import torch

        ev = torch.cuda.Event()
        ev.record()  # on the current stream, behind the forward's kernels
        return ev
