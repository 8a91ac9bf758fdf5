"""What a Neuron KV array must tell kvferry, and how we read it.

Each KV array is one of

* a torch tensor, which is what vllm-neuron hands ``register_kv_caches``: one tensor per
  layer on the ``neuron`` device, shaped (2, num_blocks, kv_heads, block_size, head_size)
  (vllm-project/vllm-neuron ``vllm_neuron/vllm/attention/attn.py``, "HND layout"), whose
  ``data_ptr()`` is the address upstream's NixlConnector registers with NIXL; CPU tensors
  too (vllm-neuron's ``VLLM_NEURON_CPU_MODE`` platform uses device type ``cpu``);
* an object following the :class:`NeuronArray` protocol (any framework can provide one:
  five plain attributes, no Neuron import needed), or
* a raw ``nrt_tensor_t*`` handle (``ctypes.c_void_p``) or :class:`~kvferry.neuron.libnrt.NrtTensor`,
  whose VA and size come from libnrt.

All resolve to a :class:`DeviceArray` with integers only.
"""

from __future__ import annotations

import ctypes
import math
import sys
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


# Device types a torch KV tensor may have here: vllm-neuron renames PrivateUse1 to
# "neuron" (vllm_neuron/vllm/platform.py); "cpu" is its CPU mode.
TORCH_DEVICE_TYPES = ("neuron", "privateuseone", "cpu")


def is_torch_tensor(obj: Any) -> bool:
    """True for a torch tensor, without importing torch for anything else."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _from_torch(name: str, t: Any, default_vnc: int) -> DeviceArray:
    """A torch KV tensor as vllm-neuron hands it: its data_ptr() is the address NIXL
    registers (what upstream's NixlConnector does), its storage the allocation."""
    if t.device.type not in TORCH_DEVICE_TYPES:
        raise TypeError(f"{name}: torch tensor on {t.device}; the neuron backend takes "
                        f"{'/'.join(TORCH_DEVICE_TYPES)} tensors (use hardware_backend "
                        f"{t.device.type!r} for these)")
    va, itemsize = int(t.data_ptr()), int(t.element_size())
    shape = tuple(int(d) for d in t.shape)
    strides = tuple(int(s) * itemsize for s in t.stride())
    extent = itemsize + sum((d - 1) * s for d, s in zip(shape, strides, strict=True))
    try:  # the allocation: overlapping views of one storage then share one region
        st = t.untyped_storage()
        end = int(st.data_ptr()) + int(st.nbytes())
    except Exception:  # a device tensor may expose no storage: its own extent then
        end = va + extent
    if va <= 0:
        raise ValueError(f"{name}: tensor has no device address ({va:#x})")
    vnc = default_vnc if t.device.index is None else int(t.device.index)
    return DeviceArray(name, va, max(end - va, extent), vnc, shape, itemsize, strides, None, t)


def resolve(name: str, obj: Any, num_blocks: int, default_vnc: int = 0) -> DeviceArray:
    """Turn one KV array object into a DeviceArray (raises TypeError/ValueError with why)."""
    if is_torch_tensor(obj):
        return _from_torch(name, obj, default_vnc)
    if isinstance(obj, ctypes.c_void_p):  # bare nrt_tensor_t*
        from kvferry.neuron.libnrt import NrtTensor, load

        if not obj.value:
            raise ValueError(f"{name}: null nrt tensor handle")
        obj = NrtTensor(obj.value, default_vnc, lib=load())
    if not isinstance(obj, NeuronArray):
        raise TypeError(
            f"{name}: {type(obj).__name__} is not a Neuron KV array; pass a torch tensor, an "
            "nrt tensor handle (ctypes.c_void_p / NrtTensor) or an object with va, shape, "
            "itemsize, vnc, nbytes (kvferry.neuron.arrays.NeuronArray)"
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
