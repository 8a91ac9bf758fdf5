"""Router configuration.

One pydantic model so the same object can be built from CLI flags, a JSON file or tests,
and is validated once at start-up rather than on every request.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

Mode = Literal["pull", "push"]
MODES: tuple[str, ...] = ("pull", "push")


class RouterSettings(BaseModel):
    """Upstreams, transfer mode and timeouts for one router process."""

    prefill_urls: list[str] = Field(min_length=1, description="Base URLs of prefill engines.")
    decode_urls: list[str] = Field(min_length=1, description="Base URLs of decode engines.")
    mode: Mode = Field("pull", description="Default transfer mode when a request names none.")
    prefill_kv_addrs: list[str] = Field(
        default_factory=list,
        description="kvferry side-channel `host:port` of each prefill engine, aligned with "
        "prefill_urls (empty: push mode is unavailable). D is told to register with it.",
    )
    prefill_engine_ids: list[str] = Field(
        default_factory=list,
        description="KV engine id of each prefill engine, aligned with prefill_urls. Only "
        "vLLM's own NixlPushConnector needs them (its D must name P's engine before P has "
        "answered); kvferry's connectors find P by its side-channel address alone.",
    )
    prefill_tp_size: int = Field(1, gt=0, description="TP size of the prefill engines, told "
                                 "to D with prefill_engine_ids (vLLM's push connector).")
    decode_control_addrs: list[str] = Field(
        default_factory=list,
        description="kvferry lease-control `host:port` of each decode engine, aligned with "
        "decode_urls (empty: no conversation reuse). The router renews, releases and looks "
        "up D's leases there.",
    )
    lease_ttl_s: float | None = Field(
        None, gt=0, description="Lease TTL asked of D per turn (default: D's decoder_kv_blocks_ttl)."
    )
    max_conversations: int = Field(100_000, gt=0, description="Conversation registry bound (LRU).")
    connect_timeout_s: float = Field(3.0, gt=0, description="TCP connect timeout per upstream call.")
    prefill_timeout_s: float = Field(
        300.0, gt=0, description="Read timeout for the prefill leg (whole prompt compute)."
    )
    decode_timeout_s: float = Field(
        300.0, gt=0, description="Read timeout for the decode leg, per received chunk."
    )
    max_connections: int = Field(1024, gt=0, description="httpx pool size shared by all upstreams.")

    @field_validator("prefill_urls", "decode_urls")
    @classmethod
    def _normalise(cls, urls: list[str]) -> list[str]:
        """Accept comma-separated entries and drop trailing slashes so paths join cleanly."""
        out: list[str] = []
        for entry in urls:
            for url in entry.split(","):
                url = url.strip().rstrip("/")
                if not url:
                    continue
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"upstream URL must start with http:// or https://: {url!r}")
                out.append(url)
        if not out:
            raise ValueError("at least one upstream URL is required")
        return out

    @field_validator("prefill_kv_addrs", "decode_control_addrs")
    @classmethod
    def _split_addrs(cls, addrs: list[str]) -> list[str]:
        """Accept comma-separated `host:port` entries; check each one parses."""
        out: list[str] = []
        for entry in addrs:
            for addr in entry.split(","):
                addr = addr.strip()
                if addr:
                    parse_addr(addr)
                    out.append(addr)
        return out

    @model_validator(mode="after")
    def _check_push(self) -> RouterSettings:
        n_kv, n_p = len(self.prefill_kv_addrs), len(self.prefill_urls)
        if n_kv and n_kv != n_p:
            raise ValueError(
                f"{n_kv} prefill kv address(es) for {n_p} prefill URL(s); give one per prefill, "
                "in the same order"
            )
        if self.prefill_engine_ids and len(self.prefill_engine_ids) != n_p:
            raise ValueError(f"{len(self.prefill_engine_ids)} prefill engine id(s) for {n_p} "
                             "prefill URL(s)")
        n_c, n_d = len(self.decode_control_addrs), len(self.decode_urls)
        if n_c and n_c != n_d:
            raise ValueError(f"{n_c} decode control address(es) for {n_d} decode URL(s)")
        if self.mode == "push" and not n_kv:
            raise ValueError("default mode push needs prefill_kv_addrs (--prefill-kv)")
        return self

    @property
    def push_available(self) -> bool:
        """True when push requests can be served (every P has a side-channel address)."""
        return bool(self.prefill_kv_addrs)

    def prefill_kv_addr(self, prefill_url: str) -> tuple[str, int] | None:
        """(host, port) of the side channel of the P at `prefill_url`, if configured."""
        try:
            i = self.prefill_urls.index(prefill_url)
        except ValueError:
            return None
        if i >= len(self.prefill_kv_addrs):
            return None
        return parse_addr(self.prefill_kv_addrs[i])

    def push_identity(self, prefill_url: str, request_id: str) -> dict[str, object]:
        """What a push D must know of P beyond its address (vLLM's push connector only):
        P's engine id, TP size and request id (the x-request-id both legs carry)."""
        try:
            eid = self.prefill_engine_ids[self.prefill_urls.index(prefill_url)]
        except (ValueError, IndexError):
            return {}
        return {"remote_engine_id": eid, "tp_size": self.prefill_tp_size,
                "remote_request_id": request_id}

    @property
    def reuse_available(self) -> bool:
        """True when conversations get D-side leases (every D has a control address)."""
        return bool(self.decode_control_addrs)

    def decode_control_addr(self, decode_url: str) -> tuple[str, int] | None:
        try:
            return parse_addr(self.decode_control_addrs[self.decode_urls.index(decode_url)])
        except (ValueError, IndexError):
            return None


def parse_addr(addr: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host, port); ValueError with the entry otherwise."""
    host, sep, port_s = addr.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ValueError(f"expected host:port, got {addr!r}")
    return host, int(port_s)
