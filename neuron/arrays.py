"""What a Neuron KV array must tell kvferry, and how we read it.

vllm-neuron keeps KV as device tensors whose ``data_ptr()`` is not the HBM address, so
we cannot reuse the torch path. Instead each KV array is either

* an object following the :class:`NeuronArray` protocol (any framework can provide one:
  five plain attributes, no Neuron import needed), or
* a raw ``nrt_tensor_t*`` handle (``ctypes.c_void_p``) or :class:`~kvferry.neuron.libnrt.NrtTensor`,
  whose VA and size come from libnrt.

Both resolve to a :class:`DeviceArray` with integers only.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class NeuronArray(Protocol):
    """A view of one KV array in Neuron HBM.

    Required attributes:
      va       device virtual address of element 0 (what NIXL registers as VRAM)
      shape    logical shape, e.g. (num_blocks, block_size, kv_heads, head_dim);
               may be ``()`` to mean "``num_blocks`` equal dense blocks"
      itemsize bytes per element
      vnc      (virtual) NeuronCore the memory belongs to; becomes Region.device_id
      nbytes   bytes of the allocation backing the array (>= the array's extent)
    Optional attributes:
      strides     byte strides (default: C-contiguous)
      nrt_handle  nrt_tensor_t* (int), needed only by host staging's default copy
    """

    @property
    def va(self) -> int: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def itemsize(self) -> int: ...
    @property
    def vnc(self) -> int: ...
    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True)
class DeviceArray:
    """A resolved KV array: integers only, plus the original object for copies."""

    name: str
    va: int
    nbytes: int
    vnc: int
    shape: tuple[int, ...]
    itemsize: int
    strides: tuple[int, ...]
    nrt_handle: int | None
    obj: Any

    @property
    def end(self) -> int:
        return self.va + self.nbytes


def contiguous_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    out = []
    acc = itemsize
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def resolve(name: str, obj: Any, num_blocks: int, default_vnc: int = 0) -> DeviceArray:
    """Turn one KV array object into a DeviceArray (raises TypeError/ValueError with why)."""
    if isinstance(obj, ctypes.c_void_p):  # bare nrt_tensor_t*
        from kvferry.neuron.libnrt import NrtTensor, load

        if not obj.value:
            raise ValueError(f"{name}: null nrt tensor handle")
        obj = NrtTensor(obj.value, default_vnc, lib=load())
    if not isinstance(obj, NeuronArray):
        raise TypeError(
            f"{name}: {type(obj).__name__} is not a Neuron KV array; pass an nrt tensor handle "
            "(ctypes.c_void_p / NrtTensor) or an object with va, shape, itemsize, vnc, nbytes "
            "(kvferry.neuron.arrays.NeuronArray). For torch tensors whose data_ptr() is not "
            "the HBM address, use neuron_staging='host' with a copy function."
        )
    va, nbytes, itemsize = int(obj.va), int(obj.nbytes), int(obj.itemsize)
    shape = tuple(int(d) for d in obj.shape)
    if va <= 0:
        raise ValueError(f"{name}: invalid device address {va:#x}")
    if not shape:  # size-only: num_blocks dense blocks
        if nbytes % num_blocks:
            raise ValueError(f"{name}: {nbytes} bytes do not split into {num_blocks} blocks")
        shape, itemsize = (num_blocks, nbytes // num_blocks), 1
    strides = tuple(int(s) for s in getattr(obj, "strides", None) or ()) or \
        contiguous_strides(shape, itemsize)
    if len(strides) != len(shape):
        raise ValueError(f"{name}: strides {strides} do not match shape {shape}")
    extent = itemsize + sum((d - 1) * s for d, s in zip(shape, strides, strict=True))
    if math.prod(shape) and extent > nbytes:
        raise ValueError(f"{name}: shape {shape} spans {extent} bytes > allocation {nbytes}")
    handle = getattr(obj, "nrt_handle", None)
    return DeviceArray(name, va, nbytes, int(obj.vnc), shape, itemsize, strides,
                       int(handle) if handle else None, obj)
