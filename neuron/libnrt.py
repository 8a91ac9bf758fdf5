"""ctypes binding to the Neuron runtime (libnrt, ``nrt/nrt.h``), without ever starting it.

kvferry runs inside a vLLM worker whose runtime the framework already started
(vllm-neuron's ``NeuronWorker`` calls ``torch.classes.neuron.Runtime().initialize()``
before the KV connector registers memory: vllm-project/vllm-neuron
``vllm_neuron/vllm/worker/neuron_worker.py``). Like NIXL's LIBFABRIC plugin
(ai-dynamo/nixl ``src/plugins/libfabric/libfabric_backend.cpp``: ``dlopen("libnrt.so.1")``
and ``nrt_get_attached_efa_bdf``) and libfabric (ofiwg/libfabric ``src/hmem_neuron.c``:
``nrt_get_total_nc_count``, "one of the few neuron functions that can be called before
nrt_init()"), kvferry only dlopens libnrt and asks it questions. There is deliberately no
binding for ``nrt_init`` / ``nrt_close``: a second init from a connector is undocumented
and the runtime's lifecycle is the framework's.

Bound: the core counts nrt.h allows before init, tensor allocate/free/VA/size/read/write
(tensors of a runtime someone else started) and ``nrt_get_attached_efa_bdf`` (which EFA
rail sits next to a piece of HBM). No Neuron SDK is importable from PyPI, so we bind the C
library directly; the tests run the same code against a fake ``libnrt`` compiled from
``tests/fakes/fake_libnrt.c``.

The library is loaded lazily (first use), from ``$KVFERRY_LIBNRT`` if set, else from the
loader path (``libnrt.so.1``), else from the Neuron SDK's default install directory.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

log = logging.getLogger(__name__)

ENV_LIBNRT = "KVFERRY_LIBNRT"
SONAME = "libnrt.so.1"
SDK_DEFAULT = "/opt/aws/neuron/lib/libnrt.so.1"

# nrt_tensor_placement_t (values are ABI, see nrt.h).
PLACEMENT_DEVICE = 0
PLACEMENT_HOST = 1
PLACEMENT_VIRTUAL = 2

_BDF_BUF = 64  # "0000:10:1c.0" is 12 chars; generous so NRT_RESOURCE is a real anomaly


class NrtStatus(IntEnum):
    """NRT_STATUS codes from nrt_status.h (only the ones a memory path can see)."""

    SUCCESS = 0
    FAILURE = 1
    INVALID = 2
    INVALID_HANDLE = 3
    RESOURCE = 4
    TIMEOUT = 5
    HW_ERROR = 6
    QUEUE_FULL = 7
    LOAD_NOT_ENOUGH_NC = 9
    UNSUPPORTED_NEFF_VERSION = 10
    FAIL_HOST_MEM_ALLOC = 11
    UNINITIALIZED = 13
    CLOSED = 14
    QUEUE_EMPTY = 15
    EXEC_BAD_INPUT = 1002
    EXEC_NC_BUSY = 1005


_MEANING = {
    NrtStatus.FAILURE: "non-specific runtime failure (see the Neuron runtime log)",
    NrtStatus.INVALID: "invalid argument",
    NrtStatus.INVALID_HANDLE: "invalid tensor/model handle",
    NrtStatus.RESOURCE: "out of a resource (device memory, or the output buffer is too small)",
    NrtStatus.TIMEOUT: "operation timed out",
    NrtStatus.HW_ERROR: "Neuron hardware error",
    NrtStatus.FAIL_HOST_MEM_ALLOC: "host memory allocation failed",
    NrtStatus.UNINITIALIZED: "runtime not initialised (the framework, e.g. libtorch-neuronx, "
                             "starts it; kvferry never calls nrt_init)",
    NrtStatus.CLOSED: "runtime already closed (nrt_close was called)",
    NrtStatus.EXEC_NC_BUSY: "NeuronCore in use by another process",
}


class LibnrtNotFound(OSError):
    """libnrt could not be loaded; the message says where we looked and what to install."""


class NrtError(RuntimeError):
    """A libnrt call returned a status other than NRT_SUCCESS."""

    def __init__(self, func: str, status: int) -> None:
        self.func = func
        self.status = status
        try:
            self.code: NrtStatus | None = NrtStatus(status)
            name = f"NRT_{self.code.name}"
        except ValueError:
            self.code = None
            name = "unknown NRT_STATUS"
        meaning = _MEANING.get(self.code, "") if self.code is not None else ""
        super().__init__(f"{func} failed: {name} ({status})" + (f": {meaning}" if meaning else ""))


class NrtInvalidError(NrtError, ValueError):
    """NRT_INVALID / NRT_INVALID_HANDLE: a caller bug, not a transient condition."""


class NrtResourceError(NrtError, MemoryError):
    """NRT_RESOURCE / NRT_FAIL_HOST_MEM_ALLOC: out of device or host memory."""


class NrtStateError(NrtError):
    """NRT_UNINITIALIZED / NRT_CLOSED: runtime lifecycle misuse."""


class NrtTimeoutError(NrtError, TimeoutError):
    """NRT_TIMEOUT."""


class NrtHardwareError(NrtError):
    """NRT_HW_ERROR: the device is unhealthy; do not retry on it."""


_ERROR_CLASS: dict[int, type[NrtError]] = {
    NrtStatus.INVALID: NrtInvalidError,
    NrtStatus.INVALID_HANDLE: NrtInvalidError,
    NrtStatus.RESOURCE: NrtResourceError,
    NrtStatus.FAIL_HOST_MEM_ALLOC: NrtResourceError,
    NrtStatus.UNINITIALIZED: NrtStateError,
    NrtStatus.CLOSED: NrtStateError,
    NrtStatus.TIMEOUT: NrtTimeoutError,
    NrtStatus.HW_ERROR: NrtHardwareError,
}


def check(func: str, status: int) -> None:
    """Raise the exception class matching ``status`` unless it is NRT_SUCCESS."""
    if status != NrtStatus.SUCCESS:
        raise _ERROR_CLASS.get(status, NrtError)(func, status)


def candidate_paths() -> list[str]:
    """Where we try to load libnrt from, in order."""
    env = os.environ.get(ENV_LIBNRT)
    if env:
        return [env]  # an explicit override must not silently fall back elsewhere
    return [SONAME, SDK_DEFAULT]


class Libnrt:
    """A loaded libnrt with typed entry points; raises NrtError subclasses on failure."""

    def __init__(self, path: str | None = None) -> None:
        paths = [path] if path else candidate_paths()
        errors = []
        for p in paths:
            try:
                self._lib = ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL)
                self.path = p
                break
            except OSError as e:
                errors.append(str(e))
        else:
            raise LibnrtNotFound(
                "cannot load the Neuron runtime library; tried "
                + "; ".join(errors)
                + f". Install aws-neuronx-runtime-lib (provides {SDK_DEFAULT}), add its "
                "directory to LD_LIBRARY_PATH, or point $" + ENV_LIBNRT + " at libnrt.so.1."
            )
        self._bind()

    def _fn(self, name: str, restype: Any, *argtypes: Any) -> Any:
        try:
            f = getattr(self._lib, name)
        except AttributeError:
            raise LibnrtNotFound(f"{self.path} has no symbol {name} (runtime too old?)") from None
        f.restype = restype
        f.argtypes = list(argtypes)
        return f

    def _bind(self) -> None:
        vp, sz, i32, u32p = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(ctypes.c_uint32)
        # nrt.h: both "can be called before nrt_init()".
        self._total_nc = self._fn("nrt_get_total_nc_count", i32, u32p)
        try:
            self._visible_nc: Any = self._fn("nrt_get_visible_nc_count", i32, u32p)
        except LibnrtNotFound:
            self._visible_nc = None
        self._alloc = self._fn("nrt_tensor_allocate", i32, i32, i32, sz, ctypes.c_char_p,
                               ctypes.POINTER(vp))
        self._free = self._fn("nrt_tensor_free", None, ctypes.POINTER(vp))
        self._get_va = self._fn("nrt_tensor_get_va", vp, vp)
        self._get_size = self._fn("nrt_tensor_get_size", sz, vp)
        self._read = self._fn("nrt_tensor_read", i32, vp, vp, sz, sz)
        self._write = self._fn("nrt_tensor_write", i32, vp, vp, sz, sz)
        # Optional: only runtimes >= 2.31 (Neuron SDK 2.29) export it.
        try:
            self._efa_bdf: Any = self._fn("nrt_get_attached_efa_bdf", i32, vp, ctypes.c_char_p,
                                          ctypes.POINTER(sz))
        except LibnrtNotFound:
            self._efa_bdf = None

    @property
    def has_efa_bdf(self) -> bool:
        return self._efa_bdf is not None

    # -- queries allowed before (and without) nrt_init -----------------------------------
    def total_nc_count(self) -> int:
        """NeuronCores on this instance (nrt_get_total_nc_count; no runtime needed)."""
        n = ctypes.c_uint32()
        check("nrt_get_total_nc_count", self._total_nc(ctypes.byref(n)))
        return int(n.value)

    def visible_nc_count(self) -> int | None:
        """NeuronCores visible to this process (None: symbol missing)."""
        if self._visible_nc is None:
            return None
        n = ctypes.c_uint32()
        check("nrt_get_visible_nc_count", self._visible_nc(ctypes.byref(n)))
        return int(n.value)

    # -- tensors of the runtime the framework started -------------------------------------
    def tensor_allocate(self, size: int, vnc: int = 0, name: str = "kvferry",
                        placement: int = PLACEMENT_DEVICE) -> int:
        """Allocate ``size`` bytes on NeuronCore ``vnc``; returns the nrt_tensor_t* handle."""
        out = ctypes.c_void_p()
        check("nrt_tensor_allocate",
              self._alloc(placement, vnc, size, name.encode(), ctypes.byref(out)))
        if not out.value:
            raise NrtError("nrt_tensor_allocate", NrtStatus.FAILURE)
        return out.value

    def tensor_free(self, handle: int) -> None:
        ref = ctypes.c_void_p(handle)
        self._free(ctypes.byref(ref))

    def tensor_get_va(self, handle: int) -> int:
        va = self._get_va(handle)
        if not va:
            raise NrtInvalidError("nrt_tensor_get_va", NrtStatus.INVALID_HANDLE)
        return int(va)

    def tensor_get_size(self, handle: int) -> int:
        return int(self._get_size(handle))

    def tensor_read(self, handle: int, host_addr: int, offset: int, size: int) -> None:
        """Device -> host: ``size`` bytes at ``offset`` of the tensor into ``host_addr``."""
        check("nrt_tensor_read", self._read(handle, host_addr, offset, size))

    def tensor_write(self, handle: int, host_addr: int, offset: int, size: int) -> None:
        """Host -> device: ``size`` bytes from ``host_addr`` into the tensor at ``offset``."""
        check("nrt_tensor_write", self._write(handle, host_addr, offset, size))

    def get_attached_efa_bdf(self, va: int) -> str:
        """PCI BDF of the EFA device attached to the HBM at ``va`` (the rail to use)."""
        if self._efa_bdf is None:
            raise NrtError("nrt_get_attached_efa_bdf (symbol missing, runtime < 2.31)",
                           NrtStatus.FAILURE)
        buf = ctypes.create_string_buffer(_BDF_BUF)
        n = ctypes.c_size_t(_BDF_BUF)
        check("nrt_get_attached_efa_bdf", self._efa_bdf(va, buf, ctypes.byref(n)))
        return buf.raw[: n.value].split(b"\0", 1)[0].decode()


_lock = threading.Lock()
_loaded: Libnrt | None = None


def load() -> Libnrt:
    """The process-wide libnrt (loaded on first call)."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = Libnrt()
        return _loaded


def is_loaded() -> bool:
    return _loaded is not None


def reset() -> None:
    """Forget the loaded library (tests switch $KVFERRY_LIBNRT between fakes)."""
    global _loaded
    with _lock:
        _loaded = None


@dataclass
class NrtTensor:
    """An nrt tensor handle plus the array view kvferry needs (implements NeuronArray).

    ``shape``/``itemsize`` describe how the engine sees the bytes; when unknown, leave
    shape empty and the backend treats the tensor as ``[num_blocks, bytes_per_block]``.
    """

    handle: int
    vnc: int
    shape: tuple[int, ...] = ()
    itemsize: int = 1
    lib: Libnrt = field(default_factory=load, repr=False)

    @classmethod
    def allocate(cls, shape: tuple[int, ...], itemsize: int, vnc: int = 0,
                 name: str = "kvferry", lib: Libnrt | None = None) -> NrtTensor:
        lib = lib or load()
        nbytes = itemsize
        for d in shape:
            nbytes *= d
        return cls(lib.tensor_allocate(nbytes, vnc, name), vnc, tuple(shape), itemsize, lib)

    @property
    def va(self) -> int:
        return self.lib.tensor_get_va(self.handle)

    @property
    def nbytes(self) -> int:
        return self.lib.tensor_get_size(self.handle)

    @property
    def nrt_handle(self) -> int:
        return self.handle

    def free(self) -> None:
        if self.handle:
            self.lib.tensor_free(self.handle)
            self.handle = 0
