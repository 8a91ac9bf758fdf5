"""NeuronBackend: vllm-neuron KV caches -> NIXL regions/planes (VRAM, or host-staged DRAM).

vllm-neuron / NxD Inference keep, per layer, separate K and V arrays shaped
``[num_blocks, block_size, kv_heads, head_dim]`` in HBM. Their torch ``data_ptr()`` is not
the HBM address, so each array must yield its device VA another way (see
:mod:`kvferry.neuron.arrays`). Every distinct allocation becomes one VRAM ``Region`` whose
``device_id`` is the NeuronCore (vnc); each array becomes one ``Plane`` per leading index.

Rail affinity: for each region we ask libnrt which EFA device sits next to that HBM
(``nrt_get_attached_efa_bdf``), the same question NIXL's LIBFABRIC plugin asks, and expose
it as :attr:`NeuronBackend.efa_bdf` so the transport can pin a region to its rail. ``None``
means "unknown: use all rails" (a warning is logged once).

``neuron_staging``: ``device`` registers HBM directly; ``host`` mirrors KV in pinned DRAM
(:mod:`kvferry.neuron.staging`); ``auto`` picks device when the host can do it (libnrt,
libfabric >= 1.21, NIXL's LIBFABRIC plugin) and host otherwise, saying why.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvferry.connectors.memory import (
    VRAM,
    KVLayout,
    MemoryBackend,
    Plane,
    Region,
    planes_of_array,
)
from kvferry.neuron.arrays import DeviceArray, resolve
from kvferry.neuron.staging import STAGING_MODES, CopyFn, HostStaging

log = logging.getLogger(__name__)

ENV_STAGING = "KVFERRY_NEURON_STAGING"
CONFIG_KEY = "neuron_staging"


def device_path_problems() -> list[str]:
    """Why HBM cannot be registered with NIXL on this host (empty: it can)."""
    from kvferry.neuron import envcheck, libnrt

    problems = []
    f = envcheck.check_libnrt()
    if f.status != envcheck.OK:
        return [f.detail]
    try:
        libnrt.load().init()  # runtime before libfabric, always
    except libnrt.NrtError as e:
        problems.append(str(e))
    for f in (envcheck.check_libfabric(), envcheck.check_nixl_plugin()):
        if f.blocking and f.status != envcheck.OK:
            problems.append(f.detail)
    return problems


class NeuronBackend(MemoryBackend):
    """Neuron HBM as NIXL VRAM through the LIBFABRIC backend (FI_HMEM_NEURON)."""

    name = "neuron"
    mem_type = VRAM
    default_nixl_backends = ("LIBFABRIC",)

    def __init__(self, staging: str | None = None, copy: CopyFn | None = None,
                 default_vnc: int = 0,
                 probe: Callable[[], list[str]] | None = None) -> None:
        self.staging_mode = self._check_mode(staging or os.environ.get(ENV_STAGING, "auto"))
        self.copy = copy
        self.default_vnc = default_vnc
        self._probe = probe or device_path_problems
        self.mode: str | None = None  # resolved by describe(): "device" | "host"
        self.nixl_backends: tuple[str, ...] = self.default_nixl_backends
        self.arrays: list[DeviceArray] = []
        self.device_layout: KVLayout | None = None
        self.staging: HostStaging | None = None
        self.efa_bdf: dict[int, str | None] = {}

    @staticmethod
    def _check_mode(mode: str) -> str:
        if mode not in STAGING_MODES:
            raise ValueError(f"{CONFIG_KEY} must be one of {STAGING_MODES}, got {mode!r}")
        return mode

    def configure(self, extra_config: Mapping[str, Any]) -> NeuronBackend:
        """Apply ``kv_connector_extra_config`` (``neuron_staging``) before describe()."""
        if CONFIG_KEY in extra_config:
            self.staging_mode = self._check_mode(str(extra_config[CONFIG_KEY]))
        return self

    # -- MemoryBackend ----------------------------------------------------------------
    def describe(self, kv_caches: Mapping[str, Any], num_blocks: int, block_size: int,
                 heads_dim: int | None = None) -> KVLayout:
        self.arrays = list(self._arrays(kv_caches, num_blocks))
        if not self.arrays:
            raise ValueError("no KV arrays to describe")
        regions, owners, region_of = self._regions(self.arrays)
        planes: list[Plane] = []
        for a in self.arrays:
            dims = [d for d, n in enumerate(a.shape) if n == num_blocks]
            if not dims:
                raise ValueError(f"{a.name}: no dimension of size num_blocks={num_blocks} in {a.shape}")
            planes += planes_of_array(region_of[a.name], a.va, list(a.shape), list(a.strides),
                                      a.itemsize, dims[0], heads_dim)
        self.device_layout = KVLayout(tuple(regions), tuple(planes), num_blocks, block_size)
        self.efa_bdf = self._rails(self.device_layout)
        self.mode = self._resolve_mode()
        if self.mode == "host":
            self.staging = HostStaging(self.device_layout, owners, self.copy)
            return self.staging.layout
        return self.device_layout

    def fall_back_to_host(self, reason: str) -> KVLayout:
        """Switch to host staging after describe() (e.g. VRAM registration failed)."""
        if self.device_layout is None:
            raise RuntimeError("describe() first")
        if self.staging is None:
            log.warning("neuron: falling back to host-staged KV transfer: %s", reason)
            regions, owners, _ = self._regions(self.arrays)
            self.staging = HostStaging(self.device_layout, owners, self.copy)
        self.mode = "host"
        return self.staging.layout

    def rails(self) -> set[str] | None:
        """Distinct EFA rails our KV sits next to; None when any region's rail is unknown."""
        if not self.efa_bdf or any(v is None for v in self.efa_bdf.values()):
            return None
        return {v for v in self.efa_bdf.values() if v is not None}

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

    def _rails(self, layout: KVLayout) -> dict[int, str | None]:
        from kvferry.neuron import libnrt

        out: dict[int, str | None] = {}
        try:
            lib = libnrt.load()
        except libnrt.LibnrtNotFound as e:
            log.warning("neuron: cannot query EFA rail affinity (%s); using all rails", e)
            return dict.fromkeys(range(len(layout.regions)))
        failed = []
        for i, r in enumerate(layout.regions):
            try:
                out[i] = lib.get_attached_efa_bdf(r.addr)
            except libnrt.NrtError as e:
                out[i] = None
                failed.append(f"region {i} (vnc {r.device_id}): {e}")
        if failed:
            log.warning("neuron: EFA rail unknown for %d region(s), using all rails: %s",
                        len(failed), "; ".join(failed[:3]))
        return out

    def _resolve_mode(self) -> str:
        if self.staging_mode != "auto":
            mode = self.staging_mode
            problems: list[str] = []
        else:
            problems = self._probe()
            mode = "host" if problems else "device"
            if problems:
                log.warning("neuron: device KV registration unavailable, using host staging: %s",
                            "; ".join(problems))
        self.nixl_backends = self.default_nixl_backends
        if mode == "host" and not self._libfabric_usable(problems):
            self.nixl_backends = ("UCX",)  # DRAM mirrors move fine over UCX
        return mode

    def _libfabric_usable(self, problems: list[str]) -> bool:
        if self.staging_mode == "auto":
            return not any("libfabric" in p for p in problems)
        from kvferry.neuron import envcheck

        return envcheck.check_libfabric().status == envcheck.OK
