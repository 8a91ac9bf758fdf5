"""Prometheus metrics for the router.

Each app gets its own CollectorRegistry so several routers can live in one process
(tests) without duplicate-metric errors.
"""

from __future__ import annotations

from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class _Memo:
    """`labels(**kw)` looked up once per label set (as the call site orders it): the
    library's own lookup validates, sorts and locks on every call, about 6 % of a short
    request's router CPU (py-spy, issue 33). `remove`/`clear` forget the lookups."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._memo: dict[tuple, Any] = {}
        super().__init__(*args, **kwargs)

    def labels(self, *values: Any, **kw: Any) -> Any:
        if values:
            return super().labels(*values)  # type: ignore[misc]
        key = tuple(kw.items())
        child = self._memo.get(key)
        if child is None:
            child = self._memo[key] = super().labels(**kw)  # type: ignore[misc]
        return child

    def remove(self, *values: Any) -> None:
        self._memo.clear()
        super().remove(*values)  # type: ignore[misc]

    def clear(self) -> None:
        self._memo.clear()
        super().clear()  # type: ignore[misc]


class Counter(_Memo, prometheus_client.Counter):
    pass


class Gauge(_Memo, prometheus_client.Gauge):
    pass


class Histogram(_Memo, prometheus_client.Histogram):
    pass


class RouterMetrics:
    """Counters, gauges and histograms exported on /metrics.

    Each metric is declared in full (name, help, labels, registry), one after the other,
    although the declarations repeat a shape (the `duplicates` tool lists them): one
    greppable declaration per exported name is what an operator reading /metrics needs,
    and a table-driven loop would hide the attribute each caller uses."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvferry_router_requests",
            "Client requests received.",
            ["endpoint", "mode"],
            registry=self.registry,
        )
        self.errors = Counter(
            "kvferry_router_errors",
            "Requests that failed, by leg (prefill/decode/router) and kind.",
            ["endpoint", "leg", "kind"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "kvferry_router_upstream_in_flight",
            "Requests currently held by each upstream.",
            ["role", "upstream"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvferry_router_ttft_seconds",
            "Client-visible time to first byte of the decode answer.",
            ["endpoint", "stream"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.prefill_seconds = Histogram(
            "kvferry_router_prefill_seconds",
            "Duration of the prefill leg.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.missing_kv_params = Counter(
            "kvferry_router_prefill_missing_kv_params",
            "Prefill answers without kv_transfer_params (decode recomputes the prompt).",
            registry=self.registry,
        )

        self.offers_released = Counter(
            "kvferry_router_offers_released",
            "Pull: P ranks told to free an offer no decode will read (D refused or failed "
            "the request), by P's answer (ok, unreachable, bad_signature...).",
            ["result"],
            registry=self.registry,
        )
        self.upstream_answers = Counter(
            "kvferry_router_upstream_answers",
            "Engine answers by leg (prefill/decode) and HTTP status code; `error` for a "
            "leg that got no answer (connection refused, timeout, dropped).",
            ["leg", "code"],
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "kvferry_router_request_seconds",
            "End-to-end time of completions and chat requests: from arrival until the last "
            "byte of the answer was handed to the server (stream or JSON), by status code.",
            ["endpoint", "code"],
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.push_prefill_failures = Counter(
            "kvferry_router_push_prefill_failures",
            "Push-mode prefill legs that failed while decode went on (decode falls back).",
            ["kind"],
            registry=self.registry,
        )

        self.conversations = Gauge(
            "kvferry_router_conversations",
            "Conversations whose last turn's KV is leased on a decode engine.",
            registry=self.registry,
        )
        self.reused_tokens = Counter(
            "kvferry_router_reused_tokens",
            "Prompt tokens prefill read back from decode instead of recomputing.",
            registry=self.registry,
        )
        self.reuse_turns = Counter(
            "kvferry_router_reuse_turns",
            "Turns of known conversations, by what prefill did with decode's KV.",
            ["reason"],
            registry=self.registry,
        )
        self.turn_routes = Counter(
            "kvferry_router_turn_routes",
            "Requests by where they were prefilled: d_local (the conversation's D, from its "
            "prefix cache), p_reuse (P, offered D's leased history), p_cold (P, no history).",
            ["route", "reason"],
            registry=self.registry,
        )
        self.d_local_tokens = Counter(
            "kvferry_router_d_local_new_tokens",
            "Estimated new tokens of the turns served D-local (what D prefilled itself).",
            registry=self.registry,
        )
        self.kv_events = Counter(
            "kvferry_router_kv_events",
            "KV cache events received from prefill engines (ok), and batches lost (gap) or "
            "unreadable (malformed).",
            ["prefill", "result"],
            registry=self.registry,
        )
        self.kv_index_blocks = Gauge(
            "kvferry_router_kv_index_blocks",
            "Cached blocks the router knows each prefill engine holds.",
            ["prefill"],
            registry=self.registry,
        )
        self.kv_aware_choices = Counter(
            "kvferry_router_kv_aware_choices",
            "Prefill choices for token-id prompts: a P holding part of the prompt (match), "
            "or none did (no_match: least loaded).",
            ["result"],
            registry=self.registry,
        )
        self.kv_aware_matched_tokens = Counter(
            "kvferry_router_kv_aware_matched_tokens",
            "Prompt tokens the chosen prefill engine held, by the router's index.",
            registry=self.registry,
        )
        self.content_matches = Counter(
            "kvferry_router_content_matches",
            "Chat requests without a conversation id, by whether their content continued a "
            "recorded turn (hit / miss), and answers that could not be recorded.",
            ["result"],
            registry=self.registry,
        )

        # -- fleet: shared state, discovery, health, retries, drain --------------------------
        self.state_errors = Counter(
            "kvferry_router_state_errors",
            "Shared-state (Redis) calls that failed or were skipped while it is down; the "
            "turn went on without reuse.",
            ["op", "kind"],
            registry=self.registry,
        )
        self.state_up = Gauge(
            "kvferry_router_state_up",
            "1 while the conversation state store answers (always 1 for memory).",
            registry=self.registry,
        )
        self.state_up.set(1)
        self.upstream_healthy = Gauge(
            "kvferry_router_upstream_healthy",
            "1 for an engine that receives work, 0 for one starting (no good answer yet) "
            "or ejected.",
            ["role", "upstream"],
            registry=self.registry,
        )
        self.upstreams = Gauge(
            "kvferry_router_upstreams",
            "Engines known to the router (static and discovered), by role.",
            ["role"],
            registry=self.registry,
        )
        self.ejections = Counter(
            "kvferry_router_ejections",
            "Engines taken out of rotation after failed health probes or requests.",
            ["role", "upstream"],
            registry=self.registry,
        )
        self.readmissions = Counter(
            "kvferry_router_readmissions",
            "Ejected engines put back after they answered /health again.",
            ["role", "upstream"],
            registry=self.registry,
        )
        self.retries = Counter(
            "kvferry_router_retries",
            "Legs retried on another engine after failing before any byte reached the client.",
            ["leg", "mode"],
            registry=self.registry,
        )
        self.migrations = Counter(
            "kvferry_router_migrations",
            "Streams whose decode engine broke mid-stream, by outcome: ok (continued on "
            "another pair), finished (D had sent everything; the router ended the stream), "
            "unsupported (the request cannot move), no_engine (no pair left to take it); "
            "rerun: a request whose D took it and dropped the connection before answering "
            "(JSON, or a stream before its first byte), served afresh by another pair.",
            ["result"],
            registry=self.registry,
        )
        self.migrated_tokens = Counter(
            "kvferry_router_migrated_tokens",
            "Tokens already sent to clients that migrations prefilled again on another pair.",
            registry=self.registry,
        )
        self.first_token = Counter(
            "kvferry_router_first_token",
            "Push streams offered P's first token (router/legs/first_token.py), by outcome: sent "
            "(P's token reached the client before D's first event), spliced (D's token 1 "
            "matched it and was dropped), mismatch (it did not: the stream went on from "
            "prompt + P's token elsewhere), d_first (D's first event came first: D's stream "
            "as is), no_token (P's answer carried no usable token).",
            ["result"],
            registry=self.registry,
        )
        self.stream_chunks = Counter(
            "kvferry_router_stream_chunks",
            "Upstream chunks of streamed answers, by how they reached the client: direct "
            "(written where D's connection received them) or pump (through the stream's "
            "task and the server's send: a head event pending, [DONE] awaiting the turn, "
            "a full client socket, or a server without the direct path).",
            ["path"],
            registry=self.registry,
        )
        self._chunks_direct = self.stream_chunks.labels(path="direct")
        self._chunks_pump = self.stream_chunks.labels(path="pump")
        self.discovery_changes = Counter(
            "kvferry_router_discovery_changes",
            "Engines added or removed by discovery.",
            ["role", "change"],
            registry=self.registry,
        )
        self.stale_entries = Counter(
            "kvferry_router_stale_conversations",
            "Turns whose conversation's decode engine is gone or ejected (recomputed).",
            registry=self.registry,
        )
        self.draining = Gauge(
            "kvferry_router_draining",
            "1 once the router stopped accepting requests and finishes those in flight.",
            registry=self.registry,
        )

    def count_stream_chunks(self, direct: int, pump: int) -> None:
        """A stream's chunks, once at its end (`stream_chunks`)."""
        self._chunks_direct.inc(direct)
        self._chunks_pump.inc(pump)

    def render(self) -> bytes:
        """Text exposition format of every metric in this registry."""
        return generate_latest(self.registry)
