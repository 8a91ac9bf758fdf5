"""kvferry's connector settings, read from vLLM's kv_connector_extra_config."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvferry.connectors.memory import HARDWARE_BACKENDS, MemoryBackend, get_backend


class ConnectorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hardware_backend: Literal["cpu", "cuda", "neuron"] = "cpu"
    transfer_mode: Literal["pull", "push"] = "pull"  # default when a request does not say
    neuron_staging: Literal["auto", "device", "host"] = "auto"  # neuron: register HBM or stage
    nixl_backends: list[str] | None = None  # default: the memory backend's choice
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = Field(5600, ge=1, le=65535)  # + tp rank
    handshake_timeout_s: float = Field(5.0, gt=0)
    # P keeps a finished prefill's blocks this long for D to read, then frees them.
    send_timeout_s: float = Field(120.0, gt=0)
    # D abandons a READ that has not completed after this long (dead peer, stuck link).
    recv_timeout_s: float = Field(30.0, gt=0)
    # Push: P holds a finished prefill this long for D's registration; a registration
    # waits this long for P's prefill (queueing + long prompts); D waits this long for the
    # WRITE, then keeps its destination blocks quarantined a little longer in case a late
    # WRITE still lands.
    push_hold_timeout_s: float = Field(30.0, gt=0)
    push_register_timeout_s: float = Field(120.0, gt=0)
    push_recv_timeout_s: float = Field(180.0, gt=0)
    push_quarantine_s: float = Field(10.0, ge=0)
    # Ask vLLM for one KV tensor whose blocks hold all layers (where the attention backend
    # allows it): a run of blocks is then one descriptor, not one per layer. Both peers
    # must agree (the layout check refuses a mix and D recomputes).
    cross_layer_blocks: bool = True

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
        return list(getattr(backend, "nixl_backends", backend.default_nixl_backends))
