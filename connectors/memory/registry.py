"""Which memory backend ``hardware_backend: NAME`` selects.

Backends register by name as ``"module:attr"`` strings, imported only when selected: the
Neuron backend (``kvferry.neuron``) builds on `backends` and needs the Neuron SDK only on
trn hosts, so naming it here as a string keeps ``connectors.memory`` free of any import
of it (no cycle, and a CPU or CUDA engine never loads it).
"""

from __future__ import annotations

import importlib

from kvferry.connectors.memory.backends import MemoryBackend

_BACKENDS: dict[str, str] = {
    "cpu": "kvferry.connectors.memory.backends:CpuBackend",
    "cuda": "kvferry.connectors.memory.backends:CudaBackend",
    "neuron": "kvferry.neuron.backend:NeuronBackend",
}
HARDWARE_BACKENDS = tuple(_BACKENDS)


def backend_class(name: str) -> type[MemoryBackend]:
    """The class registered as ``name`` (imported now)."""
    try:
        module, attr = _BACKENDS[name].split(":")
    except KeyError:
        raise ValueError(f"unknown hardware backend {name!r}; choose one of {HARDWARE_BACKENDS}") from None
    return getattr(importlib.import_module(module), attr)


def get_backend(name: str) -> MemoryBackend:
    """A fresh backend of the kind ``--hardware-backend NAME`` selects."""
    return backend_class(name)()
