"""NeuronBackend: vllm-neuron KV caches -> NIXL regions/planes, in one of three registration modes.

What arrives: vllm-neuron hands ``register_kv_caches`` one torch tensor per layer on the
``neuron`` device, shaped (2, num_blocks, kv_heads, block_size, head_size), block size 32
(vllm-project/vllm-neuron ``vllm_neuron/vllm/attention/attn.py``, ``platform.py``
``UNIFORM_NEURON_PAGE``); its platform reports ``get_nixl_supported_devices() ==
{"neuron": {"cuda"}}`` and upstream's NixlConnector registers each tensor's
``data_ptr()``. Objects of :mod:`kvferry.neuron.arrays` (nrt handles, NeuronArray views)
work too. Every distinct allocation becomes one ``Region``; each array one ``Plane`` per
leading index.

How it is registered (``neuron_staging`` in the extra config, else
``$KVFERRY_NEURON_STAGING``, else ``auto``):

``device``
    HBM as NIXL VRAM. NIXL's LIBFABRIC backend accepts VRAM only when hwloc finds a
    Neuron PCI device (vendor 0x1d0f) and no NVIDIA GPU, and then registers it with
    ``FI_HMEM_NEURON`` on the EFA rail ``nrt_get_attached_efa_bdf`` names (ai-dynamo/nixl
    ``src/utils/libfabric/libfabric_rail_manager.cpp``, ``libfabric_topology.cpp``
    ``isNeuronAccel``, ``src/plugins/libfabric/libfabric_backend.cpp`` ``registerMem``).
``mapped``
    The same addresses as DRAM. With ``NEURON_RT_MAP_HBM=1`` the runtime maps HBM into the
    host address space; AWS's disagg_serve_vllm sample registers KV this way because the
    LIBFABRIC backend in its image refused VRAM ("Memory type 1 is not supported")
    (aws-neuron/aws-neuron-eks-samples ``disagg_serve_vllm/prefill-deploy.yaml``), and
    vllm-neuron's worker sets the variable itself before starting the runtime
    (``vllm_neuron/vllm/worker/neuron_worker.py``).
``host``
    Pinned host mirrors as DRAM, copied device <-> host around every transfer
    (:mod:`kvferry.neuron.staging`; torch tensors copy with ``Tensor.copy_``).
``auto``
    device, then mapped, then host. A mode whose precondition does not hold is skipped;
    a registration NIXL refuses at engine start moves on to the next mode. Every step is
    logged and recorded in :attr:`NeuronBackend.attempts`; the mode that registered is
    :attr:`NeuronBackend.mode`.

EFA rail affinity is NIXL's own question (``nrt_get_attached_efa_bdf``, asked by its
LIBFABRIC backend at registration). kvferry never starts the Neuron runtime (see
:mod:`kvferry.neuron.libnrt`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvferry.connectors.memory.backends import (
    DRAM,
    VRAM,
    KVLayout,
    MemoryBackend,
    Plane,
    Region,
    planes_of_array,
)
from kvferry.neuron.arrays import DeviceArray, is_torch_tensor, resolve
from kvferry.neuron.staging import CopyFn, HostStaging, copy_problem

log = logging.getLogger("vllm." + __name__)  # under vLLM's handlers in an engine

ENV_STAGING = "KVFERRY_NEURON_STAGING"
CONFIG_KEY = "neuron_staging"
MODES = ("device", "mapped", "host")
STAGING_MODES = ("auto", *MODES)
ENV_MAP_HBM = "NEURON_RT_MAP_HBM"
# Which NIXL backends each mode tries, in order. UCX has no Neuron memory support, so the
# HBM modes need LIBFABRIC (AWS's sample: "backends": ["LIBFABRIC"]); host mirrors are
# plain DRAM and move over either.
MODE_BACKENDS: dict[str, tuple[tuple[str, ...], ...]] = {
    "device": (("LIBFABRIC",),),
    "mapped": (("LIBFABRIC",),),
    "host": (("LIBFABRIC",), ("UCX",)),
}
# vllm-neuron's per-layer cache is HND: (2, num_blocks, kv_heads, block_size, head_size)
# (vllm_neuron/vllm/attention/attn.py), so the KV heads are dim 2.
HND_HEADS_DIM = 2

T = TypeVar("T")


@dataclass(frozen=True)
class Attempt:
    """One step of choosing a registration: a mode skipped, refused by NIXL, or registered."""

    mode: str
    backends: tuple[str, ...]
    outcome: str  # skipped | failed | registered
    reason: str = ""


class RegistrationError(RuntimeError):
    """No registration mode worked; the message lists every attempt and why it failed."""

    def __init__(self, attempts: Sequence[Attempt]) -> None:
        self.attempts = list(attempts)
        lines = "; ".join(f"{a.mode}{'/' + '+'.join(a.backends) if a.backends else ''} "
                          f"{a.outcome}: {a.reason}" for a in attempts)
        super().__init__(f"neuron: no KV registration mode worked ({lines})")


def is_registration_error(e: BaseException) -> bool:
    """Did NIXL refuse the memory or the backend (as opposed to anything else failing)?"""
    from kvferry.connectors.transfer.transport import TransferError

    # nixl's bindings raise nixlBackendError / nixlNotFoundError from nixl or nixl_cu12/13
    return isinstance(e, TransferError) or type(e).__module__.startswith("nixl")


class NeuronBackend(MemoryBackend):
    """Neuron KV for NIXL: device VRAM, mapped HBM as DRAM, or host-staged DRAM."""

    name = "neuron"
    mem_type = VRAM
    default_nixl_backends = ("LIBFABRIC",)

    def __init__(self, staging: str | None = None, copy: CopyFn | None = None,
                 default_vnc: int = 0, env: Mapping[str, str] | None = None) -> None:
        self._env = os.environ if env is None else env
        self.staging_mode = self._check_mode(staging or self._env.get(ENV_STAGING, "auto"))
        self.copy = copy
        self.default_vnc = default_vnc
        self.forced_backends: tuple[str, ...] | None = None  # extra config nixl_backends
        self.mode: str | None = None  # the mode being tried, then the one that registered
        self.nixl_backends: tuple[str, ...] = self.default_nixl_backends
        self.attempts: list[Attempt] = []
        self.arrays: list[DeviceArray] = []
        self.device_layout: KVLayout | None = None
        self.staging: HostStaging | None = None
        self._owners: list[list[DeviceArray]] = []
        self._plan: list[tuple[str, tuple[str, ...]]] = []

    @staticmethod
    def _check_mode(mode: str) -> str:
        if mode not in STAGING_MODES:
            raise ValueError(f"{CONFIG_KEY} must be one of {STAGING_MODES}, got {mode!r}")
        return mode

    def configure(self, extra_config: Mapping[str, Any]) -> NeuronBackend:
        """Apply ``kv_connector_extra_config`` before describe(): ``neuron_staging``, and
        ``nixl_backends``, which then replaces every mode's own backend choice."""
        if CONFIG_KEY in extra_config:
            self.staging_mode = self._check_mode(str(extra_config[CONFIG_KEY]))
        if extra_config.get("nixl_backends"):
            self.forced_backends = tuple(extra_config["nixl_backends"])
        return self

    def transport_backends(self) -> tuple[str, ...]:
        """The mode's backends: a fallback to host staging switches LIBFABRIC -> UCX."""
        return self.nixl_backends

    @property  # type: ignore[override]
    def may_stage(self) -> bool:
        """Can this engine end up host-staged (so P must stage saves, D grant no leases)?"""
        return self.staging_mode in ("auto", "host")

    # -- MemoryBackend ----------------------------------------------------------------
    def kv_heads_dim(self, kv_caches: Mapping[str, Any]) -> int | None:
        """vllm-neuron's HND per-layer tensors carry the KV heads at dim 2."""
        first = next(iter(kv_caches.values()), None)
        if is_torch_tensor(first) and first.dim() == 5 and first.shape[0] == 2:
            return HND_HEADS_DIM
        return None

    def describe(self, kv_caches: Mapping[str, Any], num_blocks: int, block_size: int,
                 heads_dim: int | None = None) -> KVLayout:
        """The layout of the first registration mode to try (see :meth:`register_with`)."""
        self.arrays = list(self._arrays(kv_caches, num_blocks))
        if not self.arrays:
            raise ValueError("no KV arrays to describe")
        regions, self._owners, region_of = self._regions(self.arrays)
        planes: list[Plane] = []
        for a in self.arrays:
            dims = [d for d, n in enumerate(a.shape) if n == num_blocks]
            if not dims:
                raise ValueError(f"{a.name}: no dimension of size num_blocks={num_blocks} in {a.shape}")
            if num_blocks == 2 and len(dims) > 1:
                raise ValueError(f"{a.name}: block dimension ambiguous in {a.shape} "
                                 f"(num_blocks={num_blocks} equals the K/V axis)")
            planes += planes_of_array(region_of[a.name], a.va, list(a.shape), list(a.strides),
                                      a.itemsize, dims[0], heads_dim)
        self.device_layout = KVLayout(tuple(regions), tuple(planes), num_blocks, block_size)
        self.attempts = []
        self._plan = self._candidates()
        return self._next()

    def register_with(self, layout: KVLayout, make: Callable[[KVLayout], T]) -> T:
        """``make(layout)`` registers the layout (the connector builds its transfer worker);
        when NIXL refuses it, try the next candidate mode, until one registers or none is
        left (:class:`RegistrationError`, listing every attempt)."""
        while True:
            try:
                out = make(layout)
            except Exception as e:
                if not is_registration_error(e):
                    raise
                self._note(Attempt(str(self.mode), self.nixl_backends, "failed",
                                   f"{type(e).__name__}: {e}"))
                layout = self._next(e)
                continue
            nbytes = sum(r.length for r in layout.regions)
            self._note(Attempt(str(self.mode), self.nixl_backends, "registered",
                               f"{len(layout.regions)} {layout.regions[0].mem_type} regions, "
                               f"{nbytes} bytes"))
            return out

    # -- choosing a mode --------------------------------------------------------------
    def _note(self, a: Attempt) -> None:
        self.attempts.append(a)
        level = logging.INFO if a.outcome == "registered" else logging.WARNING
        log.log(level, "neuron: KV registration %s via %s: %s (%s)", a.mode,
                "+".join(a.backends) or "-", a.outcome, a.reason)

    def _candidates(self) -> list[tuple[str, tuple[str, ...]]]:
        plan: list[tuple[str, tuple[str, ...]]] = []
        for mode in MODES if self.staging_mode == "auto" else (self.staging_mode,):
            why = self._precondition(mode)
            if why:
                self._note(Attempt(mode, (), "skipped", why))
                continue
            tries = (self.forced_backends,) if self.forced_backends else MODE_BACKENDS[mode]
            plan += [(mode, b) for b in tries]
        return plan

    def _precondition(self, mode: str) -> str | None:
        """Why ``mode`` cannot work here, judged without touching hardware (None: try it)."""
        if mode == "mapped":
            host_memory = all(is_torch_tensor(a.obj) and a.obj.device.type == "cpu"
                              for a in self.arrays)
            if not host_memory and self._env.get(ENV_MAP_HBM) != "1":
                return (f"{ENV_MAP_HBM} is not 1, so HBM is not mapped into host address "
                        "space and must not be registered as DRAM")
        if mode == "host" and self.copy is None:
            problems = [p for a in self.arrays if (p := copy_problem(a))]
            if problems:
                return "; ".join(problems[:3])
        return None

    def _next(self, error: BaseException | None = None) -> KVLayout:
        """Switch to the next planned (mode, backends) and return its layout."""
        if not self._plan:
            raise RegistrationError(self.attempts) from error
        self.mode, self.nixl_backends = self._plan.pop(0)
        assert self.device_layout is not None
        if self.mode == "device":
            return self.device_layout
        if self.mode == "mapped":
            dev = self.device_layout
            return KVLayout(tuple(Region(r.addr, r.length, 0, DRAM) for r in dev.regions),
                            dev.planes, dev.num_blocks, dev.block_size)
        if self.staging is None:
            self.staging = HostStaging(self.device_layout, self._owners, self.copy)
        return self.staging.layout

    # -- internals ----------------------------------------------------------------------
    def _arrays(self, kv_caches: Mapping[str, Any], num_blocks: int):
        for layer, v in kv_caches.items():
            if isinstance(v, tuple | list):
                if len(v) != 2:
                    raise ValueError(f"{layer}: expected a (K, V) pair, got {len(v)} arrays")
                yield resolve(f"{layer}.k", v[0], num_blocks, self.default_vnc)
                yield resolve(f"{layer}.v", v[1], num_blocks, self.default_vnc)
            else:
                yield resolve(layer, v, num_blocks, self.default_vnc)

    @staticmethod
    def _regions(arrays: Sequence[DeviceArray]):
        """One region per allocation; overlapping arrays on one core share a region."""
        spans: list[list[Any]] = []  # [start, end, vnc, [arrays]] in first-seen order
        for a in arrays:
            hit = [s for s in spans if s[2] == a.vnc and s[0] < a.end and a.va < s[1]]
            if not hit:
                spans.append([a.va, a.end, a.vnc, [a]])
                continue
            keep = hit[0]
            for s in hit[1:]:
                keep[3] += s[3]
                keep[0], keep[1] = min(keep[0], s[0]), max(keep[1], s[1])
                spans.remove(s)
            keep[0], keep[1] = min(keep[0], a.va), max(keep[1], a.end)
            keep[3].append(a)
        for i, s in enumerate(spans):  # different cores must never overlap in VA
            for t in spans[i + 1:]:
                if s[0] < t[1] and t[0] < s[1]:
                    raise ValueError(f"arrays on vnc {s[2]} and {t[2]} overlap in VA space")
        regions = [Region(s[0], s[1] - s[0], s[2], VRAM) for s in spans]
        owners = [s[3] for s in spans]
        region_of = {a.name: i for i, s in enumerate(spans) for a in s[3]}
        return regions, owners, region_of
