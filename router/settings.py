"""Router configuration.

One pydantic model so the same object can be built from CLI flags, a JSON file or tests,
and is validated once at start-up rather than on every request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator

Mode = Literal["pull", "push"]
MODES: tuple[str, ...] = ("pull", "push")


@dataclass(frozen=True)
class EngineInfo:
    """One discovered engine: its role, URL and kvferry addresses."""

    role: Literal["prefill", "decode"]
    url: str
    kv_addr: str | None = None  # P's side channel (push)
    engine_id: str | None = None  # P's KV engine id (vLLM's push connector)
    control_addr: str | None = None  # D's lease control (reuse)


class RouterSettings(BaseModel):
    """Upstreams, transfer mode and timeouts for one router process.

    One declaration per setting, each with its bound and the text `--help` shows: runs of
    fields of the same shape are declarations, not repeated logic."""

    prefill_urls: list[str] = Field(description="Base URLs of prefill engines (static).")
    decode_urls: list[str] = Field(description="Base URLs of decode engines (static).")
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
    # -- per-turn route (turn_policy.py: defaults and the measurements behind them) -------
    d_local_max_new_tokens: int = Field(1024, ge=0, description="A turn with at most this many "
                                        "new tokens beyond the history its D holds is served by "
                                        "that D from its prefix cache, without P (0: never).")
    d_local_busy_tokens_per_s: float = Field(1200.0, ge=0, description="D-local prefill tokens "
                                             "per second a D with other requests in flight may "
                                             "take (token bucket per D; 0: only an idle D).")
    d_local_max_in_flight: int = Field(32, ge=1, description="A D with this many requests open "
                                       "from this router gets no D-local turn (1: only an idle D).")
    d_local_chars_per_token: float = Field(3.0, gt=0, description="Characters per token for a "
                                           "conversation with nothing to calibrate on yet.")
    content_reuse: bool = Field(True, description="Recognise a chat conversation without an id "
                                "from its content (history + the answers the router returned), "
                                "per tenant; an explicit id wins.")
    # -- KV-aware prefill choice (kv_events.py, kv_index.py) ------------------------------
    prefill_kv_events: list[str] = Field(default_factory=list, description="vLLM KV cache event "
                                         "endpoint (`tcp://host:port`, the engine's "
                                         "--kv-events-config) of each prefill engine, aligned "
                                         "with prefill_urls; token-id prompts then go to the P "
                                         "holding most of their prefix, weighed with load.")
    kv_aware_load_tokens: float = Field(2048.0, ge=0, description="A request in flight on a P "
                                        "weighs like this many prompt tokens it would compute.")
    kv_index_max_blocks: int = Field(1_000_000, gt=0, description="Blocks remembered per "
                                     "prefill engine (LRU).")
    connect_timeout_s: float = Field(3.0, gt=0, description="TCP connect timeout per upstream call.")
    prefill_timeout_s: float = Field(
        300.0, gt=0, description="Read timeout for the prefill leg (whole prompt compute)."
    )
    decode_timeout_s: float = Field(
        300.0, gt=0, description="Read timeout for the decode leg, per received chunk."
    )
    max_connections: int = Field(1024, gt=0, description="httpx pool size shared by all upstreams.")
    max_active: int = Field(512, gt=0, description="Completions one router process serves at "
                            "once (a stream until its end); more wait (router/api/admission.py).")
    max_queued: int = Field(1024, ge=0, description="Requests that may wait for admission; "
                            "beyond, 429 with Retry-After.")
    queue_timeout_s: float = Field(10.0, gt=0, description="Longest wait for admission; then "
                                   "503 with Retry-After.")
    push_report_wait_s: float = Field(
        2.0, ge=0, description="Push: how long D's JSON answer, or its stream's [DONE], may "
        "wait for P's answer (reuse and timing fields); P's answer is due once D answers, "
        "so this bounds a slow router loop, never a prefill.")
    # -- fleet -------------------------------------------------------------------------
    state: str = Field("memory", description="Conversation state: `memory` (this process; "
                       "with --workers > 1 a SQLite file the workers share), a Redis URL "
                       "(`redis://host:6379/0`) shared by every router replica, or "
                       "`sqlite:///path` shared by the router processes of one host.")
    state_timeout_s: float = Field(0.1, gt=0, description="Bound on each Redis call (or wait for "
                                   "the SQLite file's lock); a slower "
                                   "or failed call means no reuse for that turn.")
    state_retry_s: float = Field(1.0, ge=0, description="After a failed Redis call, how long "
                                 "turns skip Redis before it is tried again.")
    engines_file: str | None = Field(None, description="JSON file of engines, reloaded when it "
                                     "changes; its engines join the static ones.")
    discovery_interval_s: float = Field(2.0, gt=0, description="How often the engines file "
                                        "is checked for changes.")
    prefill_dns: list[str] = Field(default_factory=list, description="`name:port` DNS names "
                                   "of prefill engines (a Kubernetes headless Service: one A "
                                   "record per ready pod), resolved every dns_interval_s.")
    decode_dns: list[str] = Field(default_factory=list, description="`name:port` DNS names of "
                                  "decode engines, as prefill_dns.")
    prefill_kv_port: int | None = Field(None, gt=0, lt=65536, description="Side-channel port "
                                        "of every DNS-discovered prefill engine (push).")
    decode_control_port: int | None = Field(None, gt=0, lt=65536, description="Lease-control "
                                            "port of every DNS-discovered decode engine (reuse).")
    dns_interval_s: float = Field(5.0, gt=0, description="How often DNS names are resolved.")
    health_interval_s: float = Field(5.0, ge=0, description="Period of /health probes of every "
                                     "engine (0: no probes, passive failure counts only).")
    eject_after: int = Field(3, gt=0, description="Consecutive failures (probes or requests) "
                             "that take an engine out of rotation until it answers /health.")
    max_migrations: int = Field(2, ge=0, description="Engine pairs one stream may try after "
                                "its decode engine broke mid-stream (0: a broken stream ends "
                                "with an SSE error event).")
    first_token_from_prefill: bool = Field(True, description="Push, greedy streams: send "
                                           "the client P's first token as soon as P answers, "
                                           "then D's stream without its own token 1 "
                                           "(router/legs/first_token.py).")
    first_token_chat: bool = Field(False, description="Also for chat streams (without tools). "
                                   "Only where the engines run no reasoning parser, which could "
                                   "render token 1 differently in P's whole answer and in D's "
                                   "stream.")
    drain_timeout_s: float = Field(30.0, ge=0, description="On SIGTERM, how long in-flight "
                                   "requests may take to finish before the router exits.")
    # -- who may ask what (auth.py), and how much (intake.py, validate.py) ---------------
    api_keys_file: str | None = Field(None, description="JSON file `{\"key id\": \"key\"}` of "
                                      "router API keys, re-read when it changes (rotation "
                                      "without restart); with it, requests without a listed "
                                      "key get 401 and tenants are key ids. None: no router "
                                      "keys (engines may still check theirs).")
    operator_token: str | None = Field(None, description="Token that unlocks engine identity "
                                       "headers, /health details and ?deep=true (header "
                                       "x-kvferry-operator-token). Prefer operator_token_file "
                                       "or KVFERRY_OPERATOR_TOKEN: flags show in `ps`.")
    operator_token_file: str | None = Field(None, description="File whose content is the "
                                            "operator token.")
    max_body_bytes: int | None = Field(None, gt=0, description="Request bodies above this "
                                       "get 413 unread (default: sized for the longest "
                                       "prompt the engines' max_model_len allows).")
    max_model_len: int | None = Field(None, gt=0, description="The engines' context length "
                                      "(default: the decode engines' /v1/models "
                                      "max_model_len).")
    _discovered: dict[str, EngineInfo] = PrivateAttr(default_factory=dict)

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
                out.append(check_url(url))
        return out

    @field_validator("prefill_kv_addrs", "decode_control_addrs")
    @classmethod
    def _split_addrs(cls, addrs: list[str]) -> list[str]:
        """Accept comma-separated `host:port` entries; check each one parses. (The same
        loop as `_normalise`, kept apart on purpose: a URL is rewritten and an entry of
        only slashes dropped, an address is kept as given once it parses.)"""
        out: list[str] = []
        for entry in addrs:
            for addr in entry.split(","):
                addr = addr.strip()
                if addr:
                    parse_addr(addr)
                    out.append(addr)
        return out

    @field_validator("state")
    @classmethod
    def _check_state(cls, v: str) -> str:
        if v.startswith("sqlite://"):
            if not v.removeprefix("sqlite://").startswith("/"):
                raise ValueError(f"a SQLite state is sqlite:///absolute/path, got {v!r}")
            return v
        if v != "memory" and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"state must be memory, a redis:// URL or sqlite:///path, got {v!r}")
        return v

    @model_validator(mode="after")
    def _check_push(self) -> RouterSettings:
        if not self.discovers and not (self.prefill_urls and self.decode_urls):
            raise ValueError("at least one upstream URL is required per role (or an engines "
                             "file, or DNS names)")
        for name in (*self.prefill_dns, *self.decode_dns):
            parse_addr(name)
        n_kv, n_p = len(self.prefill_kv_addrs), len(self.prefill_urls)
        if n_kv and n_kv != n_p:
            raise ValueError(
                f"{n_kv} prefill kv address(es) for {n_p} prefill URL(s); give one per prefill, "
                "in the same order"
            )
        if self.prefill_engine_ids and len(self.prefill_engine_ids) != n_p:
            raise ValueError(f"{len(self.prefill_engine_ids)} prefill engine id(s) for {n_p} "
                             "prefill URL(s)")
        if self.prefill_kv_events and len(self.prefill_kv_events) != n_p:
            raise ValueError(f"{len(self.prefill_kv_events)} prefill KV event endpoint(s) for "
                             f"{n_p} prefill URL(s)")
        n_c, n_d = len(self.decode_control_addrs), len(self.decode_urls)
        if n_c and n_c != n_d:
            raise ValueError(f"{n_c} decode control address(es) for {n_d} decode URL(s)")
        if self.mode == "push" and not n_kv:
            raise ValueError("default mode push needs prefill_kv_addrs (--prefill-kv)")
        return self

    @property
    def discovers(self) -> bool:
        """True when engines may come and go (an engines file or DNS names)."""
        return bool(self.engines_file or self.prefill_dns or self.decode_dns)

    def set_discovered(self, engines: dict[str, EngineInfo]) -> None:
        """Engines found by discovery (url -> addresses); the static lists take precedence."""
        self._discovered = dict(engines)

    @property
    def _engines(self) -> dict[str, EngineInfo]:
        """`_discovered`, read from pydantic's private-attribute slot: `self._discovered`
        goes through the model's `__getattr__` (5 us here, on every request's path)."""
        return self.__pydantic_private__["_discovered"]  # type: ignore[index]

    def _any_discovered(self, role: str, field: str) -> bool:
        """Whether a discovered engine of `role` has an address `field`."""
        return any(getattr(e, field) for e in self._engines.values() if e.role == role)

    @property
    def push_available(self) -> bool:
        """True when push requests can be served (every P has a side-channel address)."""
        return bool(self.prefill_kv_addrs) or self._any_discovered("prefill", "kv_addr")

    def prefill_kv_addr(self, prefill_url: str) -> tuple[str, int] | None:
        """(host, port) of the side channel of the P at `prefill_url`, if configured."""
        try:
            i = self.prefill_urls.index(prefill_url)
        except ValueError:
            e = self._engines.get(prefill_url)
            return parse_addr(e.kv_addr) if e is not None and e.kv_addr else None
        if i >= len(self.prefill_kv_addrs):
            return None
        return parse_addr(self.prefill_kv_addrs[i])

    def push_identity(self, prefill_url: str, request_id: str) -> dict[str, object]:
        """What a push D must know of P beyond its address (vLLM's push connector only):
        P's engine id, TP size and request id (the x-request-id both legs carry)."""
        try:
            eid = self.prefill_engine_ids[self.prefill_urls.index(prefill_url)]
        except (ValueError, IndexError):
            e = self._engines.get(prefill_url)
            if e is None or not e.engine_id:
                return {}
            eid = e.engine_id
        return {"remote_engine_id": eid, "tp_size": self.prefill_tp_size,
                "remote_request_id": request_id}

    @property
    def reuse_available(self) -> bool:
        """True when conversations get D-side leases (every D has a control address)."""
        return bool(self.decode_control_addrs) or self._any_discovered("decode", "control_addr")

    def decode_control_addr(self, decode_url: str) -> tuple[str, int] | None:
        """(host, port) of D's lease-control channel, if known. Like `prefill_kv_addr` but
        not one helper with it on purpose: a P listed without a side channel has none (it
        is not looked up in discovery), a D listed without a control address is."""
        try:
            return parse_addr(self.decode_control_addrs[self.decode_urls.index(decode_url)])
        except (ValueError, IndexError):
            e = self._engines.get(decode_url)
            return parse_addr(e.control_addr) if e is not None and e.control_addr else None


def check_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"upstream URL must start with http:// or https://: {url!r}")
    return url


def parse_addr(addr: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host, port); ValueError with the entry otherwise."""
    host, sep, port_s = addr.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ValueError(f"expected host:port, got {addr!r}")
    return host, int(port_s)
