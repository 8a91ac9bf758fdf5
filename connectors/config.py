"""kvferry's connector settings, read from vLLM's kv_connector_extra_config."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvferry.connectors.memory.backends import MemoryBackend
from kvferry.connectors.memory.registry import HARDWARE_BACKENDS, get_backend
from kvferry.connectors.protocol import lease, push_match, push_receive, reuse

log = logging.getLogger("vllm." + __name__)

SIDE_CHANNEL_PORT = 5600  # rank r's handshake listens on side_channel_port + r


def default_control_port(side_channel_port: int, tp_size: int) -> int:
    """Where D's lease control channel listens unless configured: the port after its TP
    ranks' side-channel ports (the one rule the connector, launchers and tests share)."""
    return side_channel_port + tp_size


IDLE_POLL_S = 0.01  # transfer thread, nothing awaited: the inbox wakes it for new work
BUSY_POLL_S = 0.0005  # a READ or WRITE in flight


# Settings kvferry no longer reads, still accepted (and ignored, as they were) so that an
# existing kv_connector_extra_config keeps starting; any other unknown key is an error.
REMOVED = {"transfer_mode": "each request says pull or push (kv_transfer_params)"}


class ConnectorConfig(BaseModel):
    """kvferry's settings for one engine: vLLM's ``kv_connector_extra_config``, validated
    once at start (an unknown key or a bad value fails the engine's start, not a request)."""

    model_config = ConfigDict(extra="forbid")

    hardware_backend: Literal["cpu", "cuda", "neuron"] = "cpu"
    # neuron: how KV is registered: HBM as VRAM, mapped HBM as DRAM, host mirrors, or
    # auto (that order, falling back at engine start; kvferry/neuron/backend.py)
    neuron_staging: Literal["auto", "device", "mapped", "host"] = "auto"
    nixl_backends: list[str] | None = None  # default: the memory backend's choice
    # Upper bound (µs) on an idle NIXL progress thread's wait for events; 0 = nixl's
    # default, a thread that busy-polls one core per engine rank.
    nixl_progress_delay_us: int = Field(1000, ge=0)
    # An engine step that computes nothing (requests only waiting for KV) waits up to
    # this long for a transfer result before returning; vLLM otherwise re-steps at once,
    # spinning a core per engine while a transfer is in flight. A result ends the wait
    # at once. 0 disables.
    idle_step_wait_ms: float = Field(5.0, ge=0, le=100)
    # How often the transfer thread looks for notifications while one is awaited (a push
    # registration on P, P's Wrote on D): each interval can add to the push handoff.
    # Default (None): 0.5 ms on accelerators; 10 ms on CPU, whose engines share few cores
    # (2P2D on two cores in CI lost a transfer to the busier poll).
    notif_poll_ms: float | None = Field(None, gt=0, le=100)
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = Field(SIDE_CHANNEL_PORT, ge=1, le=65535)  # + tp rank
    # Bounds a peer's hello, and adding its agent where that waits on the peer (LIBFABRIC;
    # UCX's add is local work, bounded by recv_timeout_s: backend_settings.add_peer_bound).
    handshake_timeout_s: float = Field(5.0, gt=0)
    # P keeps a finished prefill's blocks this long for D to read, then frees them.
    send_timeout_s: float = Field(120.0, gt=0)
    # D abandons a READ that has not completed after this long (dead peer, stuck link).
    recv_timeout_s: float = Field(30.0, gt=0)
    # Push: P holds a finished prefill this long for D's registration; a registration
    # waits this long for P's prefill (queueing + long prompts); D waits this long for the
    # WRITE. Blocks of a push D gave up are reused once P said its WRITE ended, else after
    # recv_timeout_s (P's WRITE timeout) plus push_quarantine_s (protocol/push_receive.py).
    push_hold_timeout_s: float = Field(push_match.HOLD_TIMEOUT_S, gt=0)
    push_register_timeout_s: float = Field(push_match.REGISTER_TIMEOUT_S, gt=0)
    push_recv_timeout_s: float = Field(push_receive.RECV_TIMEOUT_S, gt=0)
    push_quarantine_s: float = Field(push_receive.QUARANTINE_S, ge=0)
    # Push, P: start the WRITE when the forward that computes a prompt's last tokens has
    # finished on the device (a fence recorded in wait_for_save), not a step later when
    # the scheduler has processed its output. Backends without a fence (neuron) ignore it.
    early_push: bool = True
    # Push, P (with early_push): WRITE each layer's KV of a prompt's last chunk as soon as
    # that layer is computed (vLLM's save_kv_layer, a fence per layer), so the copy
    # overlaps the rest of the forward; D still starts only after every layer arrived (one
    # Wrote notification once all layers' WRITEs are complete and the engine step after
    # the forward has begun). Needs per-layer KV planes: cross_layer_blocks false on both
    # engines where vLLM would otherwise merge the layers (CUDA); CPU KV is per layer.
    layerwise_push: bool = False
    # Ask vLLM for KV blocks that hold all layers (where the attention backend allows
    # it): a run of blocks is then one descriptor, not one per layer. vLLM 0.21-0.26: one
    # cross-layer tensor (prefer_cross_layer_blocks, V1 model runner); 0.32+ on CUDA: the
    # block-major BLHNC layout (get_required_kvcache_layout). Both peers must agree (the
    # layout check refuses a mix and D recomputes).
    cross_layer_blocks: bool = True
    # Bidirectional reuse. D: a finished turn the router marked keeps its blocks under a
    # lease for this long (renewable by heartbeats up to lease_max_lifetime_s); leases
    # hold at most lease_max_fraction of the KV cache and yield (LRU) to live requests.
    decoder_kv_blocks_ttl: float = Field(lease.DEFAULT_TTL, gt=0)
    lease_max_lifetime_s: float = Field(lease.DEFAULT_MAX_LIFETIME, gt=0)
    lease_max_fraction: float = Field(0.5, gt=0, le=1)
    # D releases least recently used leases while its free KV blocks (free or merely
    # cached) fall below this fraction of the cache, or below what its first waiting
    # request needs. A released lease's blocks come free at once, or lease_free_grace_s
    # after P last asked that it held (a READ may be running), so the reserve covers up to
    # that long of growth (16 streams decoding at ~10 ms a step grow ~300 blocks in 3 s,
    # 2% of a 13.6k-block H200 cache at 30 GiB of qwen3-8b KV).
    lease_free_watermark: float = Field(0.02, ge=0, lt=1)
    # Lease control channel (router -> D); default: default_control_port, the port after
    # the TP ranks' side-channel ports (side_channel_port + TP size).
    lease_control_port: int | None = Field(None, ge=1, le=65535)
    # P: read D's history only if at least this many tokens would be reused, only from a
    # lease that outlives now + lease_margin_s, and give up a READ after
    # reuse_read_timeout_s; D frees an ended lease's blocks no sooner than
    # lease_free_grace_s after its last "held" answer to a P about to READ.
    kv_recompute_threshold: int = Field(reuse.DEFAULT_RECOMPUTE_THRESHOLD, ge=1)
    lease_margin_s: float = Field(reuse.DEFAULT_LEASE_MARGIN, gt=0)
    reuse_read_timeout_s: float = Field(reuse.DEFAULT_READ_TIMEOUT, gt=0)
    lease_free_grace_s: float = Field(lease.DEFAULT_FREE_GRACE, gt=0)
    # Block checksums of READs (pull, reuse) and push WRITEs: the receiver compares the
    # blocks it got with the source's before using them; a mismatch recomputes
    # (transfer/verify.py). sample: the transfers whose request id hashes under
    # kv_checksum_fraction; all: every one.
    kv_checksums: Literal["off", "sample", "all"] = "sample"
    kv_checksum_fraction: float = Field(0.05, ge=0, le=1)

    @property
    def notif_poll_s(self) -> float:
        if self.notif_poll_ms is not None:
            return self.notif_poll_ms / 1e3
        return IDLE_POLL_S if self.hardware_backend == "cpu" else BUSY_POLL_S

    @model_validator(mode="before")
    @classmethod
    def _ignore_removed(cls, data: Any) -> Any:
        if isinstance(data, dict) and (old := sorted(REMOVED.keys() & data.keys())):
            log.warning("kvferry: ignoring removed settings: %s",
                        "; ".join(f"{k} ({REMOVED[k]})" for k in old))
            data = {k: v for k, v in data.items() if k not in REMOVED}
        return data

    @model_validator(mode="after")
    def _lease_timing(self) -> ConnectorConfig:
        if not self.reuse_read_timeout_s < self.lease_margin_s:
            raise ValueError("reuse_read_timeout_s must be < lease_margin_s (READs end before leases)")
        if not self.reuse_read_timeout_s < self.lease_free_grace_s:
            raise ValueError("lease_free_grace_s must exceed reuse_read_timeout_s")
        return self

    def control_port(self, tp_size: int = 1) -> int:
        return self.lease_control_port or default_control_port(self.side_channel_port, tp_size)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        cfg = cls(**(extra or {}))
        if cfg.hardware_backend not in HARDWARE_BACKENDS:
            raise ValueError(f"unknown hardware_backend {cfg.hardware_backend}")
        return cfg

    def transport_backends(self, backend: MemoryBackend | None = None) -> list[str]:
        """Explicit ``nixl_backends``, else what the (configured) memory backend chose:
        a Neuron backend that fell back to host staging switches LIBFABRIC -> UCX."""
        if self.nixl_backends:
            return list(self.nixl_backends)
        backend = backend or get_backend(self.hardware_backend)
        return list(backend.transport_backends())
