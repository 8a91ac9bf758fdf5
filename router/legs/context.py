"""What every step of a request needs: one `FlowContext` per router app, plus the small
helpers the prefill, decode and migration steps share (leg headers, passive health)."""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..conversations.front import Conversations
from ..conversations.turn_policy import LocalBudget, PolicyConfig
from ..errors import RouterError
from ..fleet.engine_limits import LimitsWatch
from ..fleet.kv_index import PrefixIndex
from ..fleet.upstreams import Upstream, UpstreamPool
from ..metrics import RouterMetrics
from ..settings import RouterSettings
from ..wire.stream_client import StreamClient

log = logging.getLogger(__name__)

TIMELINE = logging.getLogger("kvferry.router.flow")
"""The logger the router's timeline marks go to, whichever step writes them
(tests/gpu/bench_pd.py listens on this name)."""

FORWARD_HEADERS = ("authorization",)
"""Client headers passed to the engines (engines may run with --api-key)."""

PROBE_TIMEOUT_S = 10.0


@dataclass
class FlowContext:
    """Everything the chain needs; one per router app."""

    client: httpx.AsyncClient
    settings: RouterSettings
    prefill: UpstreamPool
    decode: UpstreamPool
    metrics: RouterMetrics
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    conversations: Conversations | None = None
    turn_policy: tuple[PolicyConfig, LocalBudget] | None = None  # d_local.policy_of, made on first use
    kv_index: PrefixIndex | None = None  # of the prefill engines, with KV events
    streams: StreamClient | None = None  # P and D legs; None: through `client`
    secret: bytes | None = None  # the deployment secret: signs messages to the engines
    limits: LimitsWatch | None = None  # the engines' max_model_len and version

    def timeout(self, leg: str) -> httpx.Timeout:
        """Per-leg timeouts: connect is short; read bounds each wait for bytes.

        leg is "prefill", "decode" or "probe" (health and model listing: short).
        """
        s = self.settings
        read = (s.prefill_timeout_s if leg == "prefill" else s.decode_timeout_s
                if leg == "decode" else PROBE_TIMEOUT_S)
        return _timeout(s.connect_timeout_s, read)


@functools.lru_cache(maxsize=16)
def _timeout(connect: float, read: float) -> httpx.Timeout:
    """Built once per value pair (an httpx.Timeout per leg was a measurable share of a
    short request)."""
    return httpx.Timeout(connect=connect, read=read, write=read, pool=connect)


def forward_headers(client_headers: Any, transfer_id: str) -> dict[str, str]:
    """Headers for both legs: the client's auth plus one request id shared by P and D."""
    out = {k: client_headers[k] for k in FORWARD_HEADERS if k in client_headers}
    out["x-request-id"] = transfer_id
    return out


def json_headers(headers: dict[str, str]) -> dict[str, str]:
    return {**headers, "content-type": "application/json"}


def wire_failed(pool: UpstreamPool, up: Upstream, err: RouterError) -> None:
    """A leg failed on the wire (`err`, from `errors.from_transport`): a refused connection
    ejects the engine at once (`UpstreamPool.refused`), any other failure counts like a
    failed probe. A connect timeout only counts: a busy host can be slow to accept."""
    if err.kind == "connect":
        if pool.refused(up):
            log.warning("%s %s refused a connection: ejected until it answers /health",
                        pool.role, up.url)
    else:
        passive(pool, up, False)


def passive(pool: UpstreamPool, up: Upstream, ok: bool) -> None:
    """Requests count toward an engine's health like probes do."""
    if ok:
        pool.answered(up)
    elif pool.failed(up):
        log.warning("%s %s ejected after %d failed requests", pool.role, up.url, up.failures)
