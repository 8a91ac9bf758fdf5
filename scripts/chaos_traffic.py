"""The chaos run's traffic: seeded requests with colocated references, and how each ended.

Every request is known before the run starts (single prompts and multi-turn
conversations, completions and chat, streamed or not, pull or push) together with its
reference: the same request served by one prefill engine alone (greedy, no KV moved).
A conversation's next turn extends the reference answer, so every turn has one. An
answer through the router must equal its reference (greedy tokens, and the first
token's top-5 logprobs within `TOL` where the answer carries them) or end with a clear
error (an HTTP error status with an error body, or an in-band SSE error event).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from . import sse_client
from .bench_core import operator_headers
from .modelgen import CORPUS

# First-step top-5 logprobs within TOL of the reference. tests/stack.py allows 0.15 for
# one request at a time; here prompts are prefilled in batches with the other clients'
# (and repeated prompts may hit KV that D computed itself in another batch during a
# fallback): bf16 sums in another order moved a low-ranked logprob by 0.18 (seen, tokens
# identical). A wrong or partial block moves them by whole units.
TOL = 0.3
HANG_S = 200.0  # an answer later than this is a hang (router legs: 60 s + 60 s + 90 s/chunk)
WORDS = CORPUS.split()


@dataclass
class Item:
    """One request: what to send, where, and what it must come back as."""

    endpoint: str  # "completions" | "chat"
    body: dict[str, Any]
    mode: str = "pull"
    fault: str = ""  # the fault this request belongs to ("" = background traffic)
    target: str = ""  # an engine URL for direct requests ("" = the router)
    want: dict[str, Any] | None = None  # reference: tokens, text, top (first-step logprobs)
    expect: str = "ok"  # "ok": reference or clear error; "error": a 4xx
    cid: str | None = None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"


@dataclass
class Outcome:
    """How one request of the workload ended, checked against its reference."""

    item: Item
    kind: str  # ok | error | wrong | hang | truncated | conn_error
    status: int
    detail: str
    t0: float
    t1: float
    headers: dict[str, str] = field(default_factory=dict)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(n)]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def completion(model: str, prompt: list[int], max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0, "return_token_ids": True}
    if stream:
        body["stream"] = True
    else:
        body["logprobs"] = 5
    return body


def chat(model: str, messages: list[dict[str, str]], max_tokens: int, stream: bool
         ) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens,
                            "temperature": 0}
    if stream:
        body["stream"] = True
    return body


def answer(endpoint: str, resp: dict[str, Any]) -> dict[str, Any]:
    """tokens / text / first-step top logprobs of a JSON answer."""
    ch = resp["choices"][0]
    if endpoint == "chat":
        return {"text": ch["message"]["content"] or "", "tokens": None, "top": None}
    lp = (ch.get("logprobs") or {}).get("top_logprobs") or [None]
    return {"text": ch.get("text", ""), "tokens": ch.get("token_ids"), "top": lp[0]}


def streamed(endpoint: str, lines: list[str]) -> dict[str, Any]:
    """tokens / text of an SSE body; `sse_client.StreamError` for an in-band error event,
    a malformed event or a missing [DONE]."""
    text, toks = [], []
    for ev in sse_client.events(lines):
        for ch in ev.get("choices") or []:
            if endpoint == "chat":
                text.append((ch.get("delta") or {}).get("content") or "")
            else:
                text.append(ch.get("text") or "")
                toks.extend(ch.get("token_ids") or [])
    return {"text": "".join(text), "tokens": toks or None, "top": None}


def differs(got: dict[str, Any], want: dict[str, Any]) -> str:
    """Why ``got`` is not the reference answer ("" when it is)."""
    if got["tokens"] is not None and want["tokens"] is not None:
        if list(got["tokens"]) != list(want["tokens"]):
            return f"tokens {got['tokens']} != {want['tokens']}"
    elif got["text"] != want["text"]:
        return f"text {got['text']!r} != {want['text']!r}"
    g, w = got.get("top"), want.get("top")
    if g and w:
        for tok in g.keys() & w.keys():
            if abs(g[tok] - w[tok]) > TOL:
                return f"logprob of {tok!r}: {g[tok]} vs {w[tok]}"
    return ""


def send(router: str, item: Item, client: httpx.Client) -> Outcome:
    """One request, classified; never raises."""
    url = (item.target or router) + item.path
    headers = {"x-kvferry-mode": item.mode, **operator_headers()}
    body = dict(item.body)
    if item.cid is not None and not item.target:
        body["conversation_id"] = item.cid
    t0 = time.time()
    try:
        if item.stream:
            with client.stream("POST", url, json=body, headers=headers, timeout=HANG_S) as r:
                status, hdrs = r.status_code, dict(r.headers)
                raw = r.read().decode(errors="replace")
        else:
            r = client.post(url, json=body, headers=headers, timeout=HANG_S)
            status, hdrs, raw = r.status_code, dict(r.headers), r.text
    except httpx.TimeoutException as e:
        return Outcome(item, "hang", 0, f"no answer within {HANG_S:.0f}s: {e!r}"[:300], t0,
                       time.time())
    except httpx.HTTPError as e:
        return Outcome(item, "conn_error", 0, repr(e)[:300], t0, time.time())
    t1 = time.time()
    return Outcome(item, *classify(item, status, raw), t0, t1, hdrs)


def classify(item: Item, status: int, raw: str) -> tuple[str, int, str]:
    if status >= 400:
        try:
            err = json.loads(raw)
            clear = isinstance(err, dict) and ("error" in err or "detail" in err
                                               or "message" in err)
        except ValueError:
            clear = False
        kind = "error" if clear else "unclear_error"
        return kind, status, raw[:300]
    if item.expect == "error":
        return "wrong", status, f"expected an error, got {status}: {raw[:200]}"
    if item.stream:
        try:
            got = streamed(item.endpoint, raw.splitlines())
        except sse_client.StreamError as e:  # a malformed event is no clear error
            kind = e.kind if e.kind in ("error", "truncated") else "unclear_error"
            return kind, status, "truncated" if e.kind == "truncated" else str(e)
    else:
        try:
            got = answer(item.endpoint, json.loads(raw))
        except (ValueError, KeyError, IndexError, TypeError) as e:
            return "unclear_error", status, f"bad answer {e!r}: {raw[:200]}"
    if item.want is None:
        return "ok", status, ""
    why = differs(got, item.want)
    return ("wrong", status, why[:300]) if why else ("ok", status, "")


# -- the workload -----------------------------------------------------------------------


@dataclass
class Conversation:
    """Turns sent one after another, each continuing the one before."""

    turns: list[Item]


@dataclass
class Workload:
    """The seeded requests of a chaos run: single requests and conversations."""

    singles: list[Item]
    conversations: list[Conversation]


def build(model: str, seed: int, singles: int = 24, conversations: int = 6, turns: int = 3
          ) -> Workload:
    """The seeded requests (references are filled in by `references`)."""
    rng = random.Random(seed)
    out = []
    for i in range(singles):
        stream = rng.random() < 0.4
        mode = "push" if i % 2 else "pull"
        n_out = rng.choice((6, 10, 16))
        if rng.random() < 0.65:
            out.append(Item("completions", completion(model, tokens(rng, rng.randrange(60, 800)),
                                                      n_out, stream), mode))
        else:
            msgs = [{"role": "user", "content": words(rng, rng.randrange(20, 250))}]
            out.append(Item("chat", chat(model, msgs, n_out, stream), mode))
    convs = []
    for i in range(conversations):
        ep = "chat" if i % 3 == 2 else "completions"
        mode = "push" if i % 2 else "pull"
        first = (completion(model, tokens(rng, rng.randrange(200, 500)), 12, False) if ep ==
                 "completions" else chat(model, [{"role": "user", "content": words(rng, 150)}],
                                         12, False))
        convs.append(Conversation([Item(ep, first, mode)] + [
            Item(ep, {"_new": tokens(rng, 130) if ep == "completions" else words(rng, 60),
                      "_stream": rng.random() < 0.5}, mode) for _ in range(turns - 1)]))
    return Workload(out, convs)


class NoReference(RuntimeError):
    """A reference request failed: the stack is broken before any fault, so the run stops.
    ``status``: the engine's HTTP status (0: no answer)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def reference(engines: list[str], item: Item, client: httpx.Client) -> dict[str, Any]:
    """The item served by the first prefill engine alone, asked once. Nothing retries it:
    on a healthy, warmed-up stack no reference request fails (126 of 126 over three
    seeds' workloads, measured on the chaos stack with the warm-up of chaos.run), so a
    failure here means the stack is broken and the run must say so, not paper over it."""
    body = {k: v for k, v in item.body.items() if k != "stream"}
    if item.endpoint == "completions":
        body["logprobs"] = 5
    try:
        r = client.post(engines[0] + item.path, json=body, timeout=120)
    except httpx.HTTPError as e:
        raise NoReference(f"reference {item.endpoint} request to {engines[0]}: {e!r}") from e
    if r.status_code != 200:
        raise NoReference(f"reference {item.endpoint} request to {engines[0]}: HTTP "
                          f"{r.status_code} {r.text[:300]}", r.status_code)
    return answer(item.endpoint, r.json())


def references(engines: list[str], w: Workload, model: str, client: httpx.Client) -> None:
    """Fill in every item's reference; conversation turns extend the reference answers."""
    for item in w.singles:
        item.want = reference(engines, item, client)
    for conv in w.conversations:
        prev: Item | None = None
        for item in conv.turns:
            if prev is not None:
                new, stream = item.body.pop("_new"), item.body.pop("_stream")
                assert prev.want is not None
                if item.endpoint == "completions":
                    toks = list(prev.body["prompt"]) + list(prev.want["tokens"]) + list(new)
                    item.body = completion(model, toks, 12, stream)
                else:
                    msgs = [*prev.body["messages"],
                            {"role": "assistant", "content": prev.want["text"]},
                            {"role": "user", "content": new}]
                    item.body = chat(model, msgs, 12, stream)
            item.want = reference(engines, item, client)
            prev = item
