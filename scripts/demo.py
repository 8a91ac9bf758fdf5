"""A short multi-turn chat through the router, streaming, with per-turn TTFT.

The whole history is resent every turn (as agents do) and a conversation_id rides along,
which is what a KV-cache-aware router keys its D->P reuse on.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from kvferry.router.wire.headers import (
    HDR_DECODE,
    HDR_PREFILL,
    HDR_ROUTE,
    OPERATOR_TOKEN_ENV,
    OPERATOR_TOKEN_HEADER,
    parse_report_comment,
    reuse_report,
)

from . import sse_client

TIMETABLE = " ".join(f"Boat {i} leaves pier {i % 7} at {8 + i % 10}:{i % 6}0." for i in range(90))
TURNS = (
    "Hello! Can you explain what a cache is?",
    "Tell me a short story about a ferry that carries boxes across a wide river.",
    f"Here is the ferry timetable: {TIMETABLE} Which boat leaves last?",
    "Please summarise the conversation so far in one sentence.",
)
"""Short follow-ups (turns 2 and 4) are served by D from its own cache; turn 3 pastes a
long text, so P computes it, reading the history back from D."""


class DemoError(RuntimeError):
    """The router or an engine answered with an error."""


@dataclass
class TurnResult:
    """What one streamed turn produced."""

    reply: str
    ttft_s: float
    total_s: float
    chunks: int
    prefill: str
    decode: str
    reused: int = 0  # history tokens P read back from D instead of recomputing
    reuse_reason: str = ""  # why (not): "ok", "local_hit_covers", "below_threshold", ...
    route: str = ""  # "d_local": D served the turn from its own cache, no P

    def reuse_note(self) -> str:
        if self.route == "d_local":
            return "served by D from its own cache (d_local)"
        why = REUSE_WHY.get(self.reuse_reason, self.reuse_reason)
        return f"{self.reused} history tokens reused" + (f" ({why})" if why else "")


REUSE_WHY = {
    "ok": "",
    "local_hit_covers": "P's own prefix cache already held them",
    "below_threshold": "too few new ones to beat recomputing",
    "no_offer": "",
}
"""Plain words for the router's reuse reasons (wire.HDR_REUSE_REASON)."""


def stream_chat(client: httpx.Client, url: str, body: dict[str, Any]) -> TurnResult:
    """POST one streaming chat request; TTFT is the first chunk that carries content."""
    t0 = time.perf_counter()
    ttft: float | None = None
    first_event: float | None = None
    parts: list[str] = []
    chunks = 0
    fields: dict[str, Any] = {}  # push mode: the router's fields ride in an SSE comment
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise DemoError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:500]}")
        try:
            for event in sse_client.events(_reports(r.iter_lines(), fields)):
                fields.update({k: v for k, v in event.items() if k.startswith("kvferry_")})
                if not event.get("choices"):
                    continue
                first_event = first_event or time.perf_counter()
                chunks += 1
                for choice in event.get("choices", []):
                    text = (choice.get("delta") or {}).get("content") or ""
                    if text:
                        ttft = ttft or time.perf_counter()
                        parts.append(text)
        except sse_client.StreamError as e:
            if e.kind == "error":
                raise DemoError(f"stream error: {e.detail}") from None
            if e.kind == "truncated":
                raise DemoError("stream ended without [DONE]" if chunks else "empty stream") from None
            raise DemoError(f"stream event is no JSON object: {e.detail}") from None
        headers = r.headers
    if chunks == 0:
        raise DemoError("empty stream")
    now = time.perf_counter()
    first = ttft or first_event or now
    reused, why = reuse_report(headers, fields) or (0, "")
    return TurnResult("".join(parts), first - t0, now - t0, chunks,
                      headers.get(HDR_PREFILL, "-"), headers.get(HDR_DECODE, "?"), reused, why,
                      headers.get(HDR_ROUTE, ""))


def _reports(lines: Iterator[str], fields: dict[str, Any]) -> Iterator[str]:
    """The stream's lines, collecting the router's report comment into ``fields``."""
    for line in lines:
        if (report := parse_report_comment(line)) is not None:
            fields.update(report)
        yield line


def operator_headers() -> dict[str, str]:
    """The operator token (KVFERRY_OPERATOR_TOKEN) as a request header, when set: the
    demo shows which engines served each turn, which only operators see."""
    token = os.environ.get(OPERATOR_TOKEN_ENV)
    return {OPERATOR_TOKEN_HEADER: token} if token else {}


def printable(text: str, limit: int = 160) -> str:
    """One line, control characters escaped: random-weight replies can be anything."""
    flat = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def run_demo(
    url: str,
    turns: int = 4,
    max_tokens: int = 160,
    timeout_s: float = 120.0,
    out: Callable[[str], None] = print,
) -> int:
    """Run the conversation; returns 0 on success and 1 on any error (printed)."""
    url = url.rstrip("/")
    conversation_id = uuid.uuid4().hex
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful assistant."}]
    try:
        with httpx.Client(trust_env=False, timeout=httpx.Timeout(timeout_s, connect=5),
                          headers=operator_headers()) as c:
            models = c.get(url + "/v1/models")
            if models.status_code != 200:
                raise DemoError(f"/v1/models: HTTP {models.status_code}: {models.text[:300]}")
            model = models.json()["data"][0]["id"]
            out(f"model {model} via {url}, conversation {conversation_id}")
            for i, question in enumerate(TURNS[:turns], start=1):
                messages.append({"role": "user", "content": question})
                body = {"model": model, "messages": messages, "max_tokens": max_tokens,
                        "temperature": 0, "stream": True, "conversation_id": conversation_id}
                res = stream_chat(c, url, body)
                messages.append({"role": "assistant", "content": res.reply})
                out(f"turn {i}: ttft {res.ttft_s * 1000:.0f} ms, total {res.total_s * 1000:.0f} ms,"
                    f" {res.chunks} chunks, {len(messages) - 1} messages,"
                    f" {res.reuse_note()} (P {res.prefill}, D {res.decode})")
                out(f"  user: {question}")
                out(f"  assistant: {printable(res.reply)}")
            # End of conversation: D frees the leased blocks now, not at lease expiry.
            c.delete(url + f"/v1/kvferry/conversations/{conversation_id}")
    except (DemoError, httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError) as exc:
        out(f"demo failed: {type(exc).__name__}: {exc}")
        return 1
    out("demo ok")
    return 0
