"""Building blocks of `kvferry bench`: arrivals, prompts, one streamed request (statistics
over the results: bench_stats.py).

Everything here is independent of the CLI so tests can drive it directly. Times are
`time.perf_counter()` seconds; reported latencies are milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvferry.router.wire.headers import (
    BODY_PREFILL_MS,
    HDR_PREFILL_MS,
    OPERATOR_TOKEN_ENV,
    OPERATOR_TOKEN_HEADER,
    parse_report_comment,
    reuse_report,
)

MIN_TOKEN_ID = 10
"""Prompt token ids are drawn from [MIN_TOKEN_ID, vocab): low ids are often special tokens."""

PERF_TO_UNIX = time.time() - time.perf_counter()
"""perf_counter seconds + this = Unix time (records join the timeline marks by it)."""


# --- targets -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """One stack under test: `name=url[,impl=...,mode=...,model=...,x-header=value...]`."""

    name: str
    url: str
    impl: str = "kvferry"
    mode: str = "pull"
    model: str | None = None  # served model name sent in the body (None: ask /v1/models)
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def salt(self) -> str:
        return self.name


def operator_headers() -> dict[str, str]:
    """The router's operator token (KVFERRY_OPERATOR_TOKEN) as a request header, when set:
    answers then say which engines served them (x-kvferry-prefill, -decode, -transfer-id)
    and P's time, which the bench records."""
    token = os.environ.get(OPERATOR_TOKEN_ENV)
    return {OPERATOR_TOKEN_HEADER: token} if token else {}


def parse_target(spec: str, default_impl: str, default_mode: str) -> Target:
    """`http://h:p`, `name=http://h:p` or `name=http://h:p,impl=x,mode=y,model=m,x-kvferry-mode=push`.

    Keys starting with `x-` become request headers (e.g. `x-kvferry-mode=push` makes the
    router use push for this target only).
    """
    first, *rest = [p.strip() for p in spec.split(",") if p.strip()] or [""]
    if "=" in first and not first.startswith(("http://", "https://")):
        name, url = first.split("=", 1)
    else:
        name, url = "", first
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"target {spec!r}: expected [name=]http(s)://host:port[,key=value...]")
    url = url.rstrip("/")
    opts: dict[str, str] = {}
    headers: list[tuple[str, str]] = []
    for kv in rest:
        if "=" not in kv:
            raise ValueError(f"target {spec!r}: {kv!r} is not key=value")
        k, v = (s.strip() for s in kv.split("=", 1))
        if k.lower().startswith("x-"):
            headers.append((k.lower(), v))
        elif k in ("impl", "mode", "model"):
            opts[k] = v
        else:
            raise ValueError(f"target {spec!r}: unknown key {k!r} (impl, mode, model, x-<header>)")
    mode = opts.get("mode", default_mode)
    return Target(name=name or f"{opts.get('impl', default_impl)}-{mode}", url=url,
                  impl=opts.get("impl", default_impl), mode=mode, model=opts.get("model"),
                  headers=tuple(headers))


def split_list(values: Sequence[str], cast: type) -> list[Any]:
    """["1,2", "4"] -> [1, 2, 4] (comma lists, repeatable options)."""
    out = []
    for v in values:
        out += [cast(x.strip()) for x in str(v).split(",") if x.strip()]
    return out


# --- arrivals and prompts ----------------------------------------------------------------

def arrival_offsets(qps: float, process: str, seed: str, count: int | None,
                    duration_s: float | None) -> list[float]:
    """Send times (s from the start of the point) of an open-loop arrival process.

    `fixed`: i / qps. `poisson`: first at 0, then exponential gaps of mean 1/qps (seeded).
    Bounded by `count` arrivals and/or arrivals before `duration_s` (at least one bound).
    """
    if qps <= 0:
        raise ValueError("open-loop arrivals need qps > 0 (qps 0 runs one at a time)")
    if count is None and duration_s is None:
        raise ValueError("bound the run with a count or a duration")
    if process not in ("poisson", "fixed"):
        raise ValueError(f"unknown arrival process {process!r}")
    rng = random.Random(f"arrivals:{seed}")
    out: list[float] = []
    t = 0.0
    while count is None or len(out) < count:
        if duration_s is not None and t >= duration_s:
            break
        out.append(t)
        t = len(out) / qps if process == "fixed" else t + rng.expovariate(qps)
    return out


def random_tokens(seed: str, n: int, vocab: int) -> list[int]:
    """`n` token ids in [MIN_TOKEN_ID, vocab), deterministic for a seed string."""
    if vocab <= MIN_TOKEN_ID:
        raise ValueError(f"vocab must be > {MIN_TOKEN_ID}")
    return random.Random(seed).choices(range(MIN_TOKEN_ID, vocab), k=max(0, n))


def make_prompt(seed: str, length: int, vocab: int, prefix: list[int] | None = None) -> list[int]:
    """A random prompt of exactly `length` ids that starts with `prefix` (if any)."""
    prefix = (prefix or [])[:length]
    return prefix + random_tokens(seed, length - len(prefix), vocab)


def request_body(prompt: list[int], output_len: int, model: str | None,
                 conversation_id: str | None = None, token_ids: bool = False) -> dict[str, Any]:
    """The /v1/completions body: greedy, streamed, exactly `output_len` tokens."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        # Per-chunk token counts (vLLM): detects token chunks even when their text is empty.
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if model:
        body["model"] = model
    if conversation_id is not None:
        body["conversation_id"] = conversation_id
    if token_ids:
        body["return_token_ids"] = True  # multi-turn: the next prompt appends the real output
    return body


# --- one request -------------------------------------------------------------------------

@dataclass
class Result:
    """What one request measured."""

    target: str
    index: int
    prompt_len: int
    turn: int | None = None
    conversation: int | None = None
    scheduled: float = 0.0  # planned send time (perf_counter)
    sent: float = 0.0
    first: float | None = None  # first chunk carrying a token
    second: float | None = None  # the next chunk carrying a token
    tokens_by_second: int | None = None  # tokens the stream had delivered with that chunk
    last: float | None = None  # last chunk carrying a token
    end: float | None = None  # stream finished ([DONE] or close)
    n_tokens: int = 0
    output_ids: list[int] | None = None
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    prefill_ms: float | None = None
    cached_tokens: int | None = None
    reused_tokens: int | None = None  # history P read back from D (conversation turns)
    reuse_reason: str | None = None  # the router's word for why (not)
    error: str | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first is None else (self.first - self.sent) * 1e3

    @property
    def tpot_ms(self) -> float | None:
        if self.first is None or self.last is None or self.n_tokens < 2:
            return None
        return (self.last - self.first) * 1e3 / (self.n_tokens - 1)

    @property
    def t2_ms(self) -> float | None:
        """Send -> the second chunk carrying a token: when decoding visibly goes on (a first
        token sent early, e.g. P's, moves TTFT but not this)."""
        return None if self.second is None else (self.second - self.sent) * 1e3

    @property
    def tpot_decode_ms(self) -> float | None:
        """(last - second chunk) / the tokens after it: TPOT without the token-1 -> token-2
        gap, which a first token sent early lengthens without slowing any later token."""
        if self.second is None or self.last is None or self.tokens_by_second is None:
            return None
        after = self.n_tokens - self.tokens_by_second
        return (self.last - self.second) * 1e3 / after if after >= 1 else None

    @property
    def e2e_ms(self) -> float | None:
        return None if self.end is None else (self.end - self.sent) * 1e3

    @property
    def handoff_ms(self) -> float | None:
        ttft = self.ttft_ms
        return None if ttft is None or self.prefill_ms is None else ttft - self.prefill_ms

    @property
    def send_lag_ms(self) -> float:
        return max(0.0, (self.sent - self.scheduled) * 1e3)

    def record(self, t0: float) -> dict[str, Any]:
        """Per-request JSON (for --raw). ``sent_unix``/``first_unix``: the same instants on
        the wall clock, which the engines' and router's timeline marks use (one host)."""
        def rel(t: float | None) -> float | None:
            return None if t is None else round((t - t0) * 1e3, 3)

        def unix(t: float | None) -> float | None:
            return None if t is None else round(t + PERF_TO_UNIX, 6)
        return {
            "target": self.target, "index": self.index, "turn": self.turn,
            "conversation": self.conversation, "prompt_len": self.prompt_len,
            "sent_ms": rel(self.sent), "first_ms": rel(self.first), "last_ms": rel(self.last),
            "end_ms": rel(self.end), "second_ms": rel(self.second), "ttft_ms": self.ttft_ms,
            "tpot_ms": self.tpot_ms, "tpot_decode_ms": self.tpot_decode_ms,
            "handoff_ms": self.handoff_ms, "prefill_ms": self.prefill_ms,
            "n_tokens": self.n_tokens, "cached_tokens": self.cached_tokens,
            "reused_tokens": self.reused_tokens, "reuse_reason": self.reuse_reason,
            "status": self.status, "headers": self.headers, "error": self.error,
            "sent_unix": unix(self.sent), "first_unix": unix(self.first),
        }


class StreamState:
    """Incremental parser of one /v1/completions SSE stream."""

    def __init__(self, res: Result) -> None:
        self.res = res
        self.chunks = 0  # chunks that carried a token
        self.ids: list[int] = []
        self.text = ""  # the stream's text, as a client would show it
        self.saw_ids = False
        self.usage_tokens: int | None = None
        self.done = False

    def feed(self, line: str, now: float) -> None:
        line = line.strip()
        if (report := parse_report_comment(line)) is not None:  # a push stream's report
            self._report(report)
            return
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except ValueError:
            return
        if not isinstance(obj, dict):
            return
        if "error" in obj:
            err = obj["error"]
            msg = err.get("message") if isinstance(err, dict) else err
            self.res.error = f"stream error: {str(msg)[:200]}"
            return
        self._report(obj)
        carried = False
        for ch in obj.get("choices") or []:
            text = ch.get("text")
            if text is None and isinstance(ch.get("delta"), dict):
                text = ch["delta"].get("content")
            self.text += text or ""
            tids = ch.get("token_ids")
            if isinstance(tids, list):
                self.saw_ids = True
                self.ids += [int(t) for t in tids]
            if text or tids:
                carried = True
        usage = obj.get("usage")
        if isinstance(usage, dict):
            ct = usage.get("completion_tokens")
            if isinstance(ct, int):
                if ct > (self.usage_tokens or 0):
                    carried = True
                self.usage_tokens = ct
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                self.res.cached_tokens = details["cached_tokens"]
        if carried:
            self.chunks += 1
            if self.res.first is None:
                self.res.first = now
            elif self.chunks == 2:
                self.res.second = now
                self.res.tokens_by_second = self._tokens()
            self.res.last = now

    def _report(self, fields: dict[str, Any]) -> None:
        """The router's fields (P's time, reuse) where the answer carried them."""
        if isinstance(fields.get(BODY_PREFILL_MS), int | float) and self.res.prefill_ms is None:
            self.res.prefill_ms = float(fields[BODY_PREFILL_MS])
        if self.res.reused_tokens is None and (rep := reuse_report({}, fields)) is not None:
            self.res.reused_tokens, self.res.reuse_reason = rep

    def _tokens(self) -> int:
        """Tokens delivered so far: vLLM's running usage count, else token ids, else chunks."""
        if self.usage_tokens is not None:
            return self.usage_tokens
        return len(self.ids) if self.saw_ids else self.chunks

    def finish(self, now: float) -> None:
        r = self.res
        r.end = now
        r.n_tokens = self._tokens()
        r.output_ids = self.ids if self.saw_ids else None
        if r.error is None and r.first is None:
            r.error = "no tokens in the stream"


async def send_request(client: httpx.AsyncClient, target: Target, body: dict[str, Any],
                       res: Result, timeout_s: float) -> Result:
    """POST one streamed completion and fill `res`; never raises, never outlives timeout_s."""
    content = json.dumps(body, separators=(",", ":")).encode()
    headers = {"content-type": "application/json", **operator_headers(), **dict(target.headers)}
    state = StreamState(res)
    res.sent = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", target.url + "/v1/completions", content=content,
                                     headers=headers) as resp:
                res.status = resp.status_code
                res.headers = {k.lower(): v for k, v in resp.headers.items()
                               if k.lower().startswith("x-kvferry")}
                hdr = res.headers.get(HDR_PREFILL_MS)
                if hdr is not None:
                    with contextlib.suppress(ValueError):
                        res.prefill_ms = float(hdr)
                if (rep := reuse_report(res.headers, {})) is not None:
                    res.reused_tokens, res.reuse_reason = rep
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    res.error = f"HTTP {resp.status_code}: {text[:200]}"
                    res.end = time.perf_counter()
                    return res
                async for line in resp.aiter_lines():
                    state.feed(line, time.perf_counter())
                    if state.done:
                        break
        state.finish(time.perf_counter())
    except TimeoutError:
        res.timed_out = True
        res.error = f"timeout after {timeout_s:g}s"
    except (httpx.HTTPError, OSError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:300]
        res.end = time.perf_counter()
    return res
