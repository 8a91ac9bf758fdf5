"""Mid-stream migration (router/legs/migrate.py, router/wire/resume*.py) over real HTTP with fake
engines: a D that dies (connection cut mid-body), sends an error event or ends early, and
a stream that must go on, token for token, on another pair.

The fakes are a deterministic "model" (`FakeModel`): each next token is a function of the
whole sequence so far (position included), so a continuation is token-identical to an
uninterrupted run only when it was given exactly the prompt's and the sent tokens' ids.
They answer the way vLLM's OpenAI server does (field names, `return_token_ids`,
`prompt_token_ids` on the first event, usage, [DONE]).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from helpers_http import serve

from kvferry.router.api.app import create_app
from kvferry.router.settings import RouterSettings
from kvferry.router.wire import resume, resume_request
from kvferry.router.wire.bodies import CHAT, COMPLETIONS

PROMPT = [11, 12, 13, 14, 15, 16]
AUTH = {"authorization": "Bearer key-A"}


def next_token(seq: list[int]) -> int:
    return (seq[-1] * 7 + len(seq) * 13 + (seq[-2] if len(seq) > 1 else 0)) % 900 + 10


def greedy(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def render(messages: list[dict[str, str]]) -> list[int]:
    """The fake chat template: every character of every message, then the assistant tag."""
    text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
    return [ord(c) % 900 + 10 for c in text]


def text_ids(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


class FakeModel:
    """A fake vLLM engine (P or D) serving `next_token`'s greedy output.

    `break_after` (events, then the connection is cut without ending the chunked body),
    `error_after` (events, then vLLM's in-band error event and [DONE]) and `stop_early`
    (no [DONE]) apply to this engine's next stream only, like a D that dies once.
    """

    def __init__(self, name: str, role: str = "decode") -> None:
        self.name = name
        self.role = role
        self.received: list[tuple[str, dict[str, Any]]] = []
        self.break_after: int | None = None
        self.error_after: int | None = None
        self.stop_early = False
        self.lease_offer = False
        self.answer_delay_s = 0.0  # prefill: before answering
        self.answer_gate: threading.Event | None = None  # prefill: answer once it is set
        self.token_one_shift = 0  # prefill: answer another token 1 than the model's
        self.first_gate: threading.Event | None = None  # decode: first event once it is set
        self.first_event_at: float | None = None  # decode: when it was sent (perf_counter)
        self.burst = 1  # decode: tokens in the first token event (vLLM merges outputs that
        # pile up while its API server is busy)

    def app(self) -> FastAPI:
        app = FastAPI()

        async def answer(request: Request, chat: bool) -> Any:
            body = await request.json()
            self.received.append(("chat" if chat else "completions", body))
            prompt = render(body["messages"]) if chat else (
                body["prompt"] if isinstance(body["prompt"], list) else
                [ord(c) % 900 + 10 for c in body["prompt"]])
            limit = body.get("max_completion_tokens", body.get("max_tokens"))
            out = greedy(prompt, 16 if limit is None else limit)
            if self.role == "prefill":
                return await self._prefill_answer(body, chat, prompt, out)
            if not body.get("stream"):
                return JSONResponse({"id": f"{self.name}-json", "choices": [
                    {"index": 0, "text": " ".join(f"t{t}" for t in out)}]})
            return StreamingResponse(self._events(body, chat, prompt, out),
                                     media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await answer(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            return await answer(request, chat=True)

        @app.get("/health")
        async def health() -> Any:
            return {}

        return app

    async def _prefill_answer(self, body: dict[str, Any], chat: bool, prompt: list[int],
                              out: list[int]) -> JSONResponse:
        """vLLM's JSON answer to a prefill leg (max_tokens 1), token ids when asked."""
        await asyncio.sleep(self.answer_delay_s)
        if self.answer_gate is not None:
            assert await asyncio.to_thread(self.answer_gate.wait, 20), "gate never opened"
        ids = bool(body.get("return_token_ids"))
        t = out[0] + self.token_one_shift
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": f"t{t} ",
                                              "reasoning": None, "tool_calls": []},
                      "finish_reason": "length", "token_ids": [t] if ids else None}
        else:
            choice = {"index": 0, "text": f"t{t} ", "finish_reason": "length",
                      "prompt_token_ids": prompt if ids else None,
                      "token_ids": [t] if ids else None}
        return JSONResponse({"id": "p-answer", "created": 999, "model": "fake",
                             "choices": [choice],
                             **({"prompt_token_ids": prompt if ids else None} if chat else {}),
                             "kv_transfer_params": {"remote_engine_id": self.name}})

    async def _events(self, body: dict[str, Any], chat: bool, prompt: list[int],
                      out: list[int]) -> AsyncIterator[bytes]:
        ids = bool(body.get("return_token_ids"))
        head = {"id": f"{self.name}-{len(self.received)}", "created": 1000 + len(self.received),
                "model": "fake", "object": "chat.completion.chunk" if chat else "text_completion"}
        events: list[dict[str, Any]] = []
        if chat:
            events.append({**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                           "content": ""}, "logprobs": None, "finish_reason": None}],
                           "prompt_token_ids": prompt if ids else None})
        for i, t in enumerate(out):
            finish = "length" if i == len(out) - 1 else None
            if chat:
                choice = {"index": 0, "delta": {"content": f"t{t} "}, "logprobs": None,
                          "finish_reason": finish, "token_ids": [t] if ids else None}
            else:
                choice = {"index": 0, "text": f"t{t} ", "logprobs": None,
                          "finish_reason": finish, "stop_reason": None,
                          "prompt_token_ids": prompt if ids and i == 0 else None,
                          "token_ids": [t] if ids else None}
            event = {**head, "choices": [choice]}
            if finish and self.lease_offer:
                lease = (body.get("kv_transfer_params") or {}).get("lease") or {}
                event["kv_transfer_params"] = {"lease": {
                    "engine_id": self.name, "lease_id": lease.get("lease_id"),
                    "expiry": time.time() + 100, "num_tokens": len(prompt) + len(out)}}
            events.append(event)
        if self.burst > 1:  # the first `burst` token events as one
            first = 1 if chat else 0
            merged = [e["choices"][0] for e in events[first:first + self.burst]]
            head_choice = dict(merged[0])
            if chat:
                head_choice["delta"] = {"content": "".join(c["delta"]["content"] for c in merged)}
            else:
                head_choice["text"] = "".join(c["text"] for c in merged)
            if ids:
                head_choice["token_ids"] = [t for c in merged for t in c["token_ids"]]
            head_choice["finish_reason"] = merged[-1]["finish_reason"]
            events[first:first + self.burst] = [{**events[first], "choices": [head_choice]}]
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({**head, "choices": [], "usage": {
                "prompt_tokens": len(prompt), "completion_tokens": len(out),
                "total_tokens": len(prompt) + len(out)}})
        cut, err, early = self.break_after, self.error_after, self.stop_early
        self.break_after = self.error_after = None
        self.stop_early = False
        if self.first_gate is not None:
            assert await asyncio.to_thread(self.first_gate.wait, 20), "gate never opened"
        self.first_event_at = time.perf_counter()
        for i, e in enumerate(events):
            if cut is not None and i == cut:
                raise ConnectionError(f"fake {self.name} dies")  # body cut mid-stream
            if err is not None and i == err:
                yield b'data: {"error": {"message": "engine core died", "code": 500}}\n\n'
                yield b"data: [DONE]\n\n"
                return
            yield f"data: {json.dumps(e)}\n\n".encode()
        if not early:
            yield b"data: [DONE]\n\n"


@pytest.fixture
def fleet() -> Iterator[Any]:
    stack = ExitStack()

    def make(n_d: int = 2, **kw: Any) -> tuple[str, FakeModel, list[FakeModel], Any]:
        p = FakeModel("p0", "prefill")
        ds = [FakeModel(f"d{i}") for i in range(n_d)]
        purl = stack.enter_context(serve(p.app()))
        durls = [stack.enter_context(serve(d.app())) for d in ds]
        kw.setdefault("health_interval_s", 0)
        app = create_app(RouterSettings(prefill_urls=[purl], decode_urls=durls, **kw), b"k")
        return stack.enter_context(serve(app)), p, ds, app

    with stack:
        yield make


def stream(url: str, body: dict[str, Any], chat: bool = False,
           headers: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], bytes]:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with httpx.stream("POST", url + path, json={"model": "fake", "stream": True, **body},
                      headers=headers, timeout=20, trust_env=False) as r:
        assert r.status_code == 200
        raw = r.read()
    assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"[DONE]") == 1
    events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    return events, raw


def tokens_of(events: list[dict[str, Any]]) -> list[int]:
    text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                   for e in events for c in e.get("choices", []))
    return text_ids(text)


def metric(app: Any, name: str, **labels: str) -> float:
    return app.state.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_dead_decode_mid_stream_continues_token_for_token(fleet, mode: str) -> None:
    url, p, ds, app = fleet(prefill_kv_addrs=["127.0.0.1:5600"])
    ds[0].break_after = 4  # the first D of a fresh pool serves the stream; it dies
    events, _ = stream(url, {"prompt": PROMPT, "max_tokens": 12},
                       headers={"x-kvferry-mode": mode})
    assert tokens_of(events) == greedy(PROMPT, 12)
    events = [e for e in events if "id" in e]  # not push's report event
    assert {e["id"] for e in events} == {events[0]["id"]}  # one stream, one id
    assert {e["created"] for e in events} == {events[0]["created"]}
    assert all(c["token_ids"] is None and c["prompt_token_ids"] is None
               for e in events for c in e["choices"])  # the client did not ask for them
    assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "length"
    assert ds[0].received[0][1]["return_token_ids"] is True
    [(path, cont)] = ds[1].received
    assert path == "completions" and cont["prompt"] == PROMPT + greedy(PROMPT, 4)
    assert cont["max_tokens"] == 8 and cont["kv_transfer_params"] == {"remote_engine_id": "p0"}
    assert p.received[-1][1]["prompt"] == cont["prompt"] and p.received[-1][1]["max_tokens"] == 1
    assert metric(app, "kvferry_router_migrations_total", result="ok") == 1
    assert metric(app, "kvferry_router_migrated_tokens_total") == 4
    assert metric(app, "kvferry_router_upstream_in_flight", role="decode",
                  upstream=app.state.pools["decode"].upstreams[0].name) == 0


def test_chat_continues_as_chat_with_usage_and_ids(fleet) -> None:
    """A chat stream continues through /v1/completions on the rendered prompt's ids; the
    client still gets chat chunks, token ids it asked for exactly once each, and usage over
    the original prompt and every token."""
    url, _, ds, app = fleet()
    ds[0].break_after = 3  # the role chunk and two tokens
    messages = [{"role": "user", "content": "hi there"}]
    events, _ = stream(url, {"messages": messages, "max_completion_tokens": 9,
                             "return_token_ids": True,
                             "stream_options": {"include_usage": True}}, chat=True)
    want = greedy(render(messages), 9)
    assert tokens_of(events) == want
    assert [t for e in events for c in e["choices"] for t in (c.get("token_ids") or [])] == want
    assert [e.get("prompt_token_ids") for e in events if e.get("prompt_token_ids")] == [
        render(messages)]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert sum(1 for e in events for c in e["choices"] if c["delta"].get("role")) == 1
    assert {e["id"] for e in events} == {events[0]["id"]}
    assert events[-1]["usage"] == {"prompt_tokens": len(render(messages)),
                                   "completion_tokens": 9,
                                   "total_tokens": len(render(messages)) + 9}
    [(_, body)] = [r for d in ds for r in d.received if r[0] == "completions"]
    assert body["prompt"] == render(messages) + want[:2] and body["max_tokens"] == 7
    assert "messages" not in body
    assert metric(app, "kvferry_router_migrations_total", result="ok") == 1


@pytest.mark.parametrize("fault", ["error_after", "stop_early"])
def test_error_event_or_early_end_migrates(fleet, fault: str) -> None:
    url, _, ds, app = fleet()
    if fault == "error_after":
        ds[0].error_after = 5
    else:
        ds[0].stop_early = True
    events, raw = stream(url, {"prompt": "hello", "max_tokens": 10})
    assert b"engine core died" not in raw and not any("error" in e for e in events)
    assert tokens_of(events) == greedy([ord(c) % 900 + 10 for c in "hello"], 10)
    # Text prompt: the continuation's prompt is the ids D reported for it.
    cont = [b for d in ds for path, b in d.received if isinstance(b["prompt"], list)]
    if fault == "error_after":
        assert len(cont) == 1 and len(cont[0]["prompt"]) == 5 + 5
        assert metric(app, "kvferry_router_migrations_total", result="ok") == 1
    else:  # every token and finish_reason passed: the router only ends the stream
        assert cont == []
        assert metric(app, "kvferry_router_migrations_total", result="finished") == 1


def test_two_breaks_three_engines(fleet) -> None:
    url, _, ds, app = fleet(n_d=3)
    ds[0].break_after = ds[1].break_after = 3  # D0 dies, then D1 (the continuation)
    events, _ = stream(url, {"prompt": PROMPT, "max_tokens": 10, "min_tokens": 8})
    assert tokens_of(events) == greedy(PROMPT, 10)
    conts = sorted((b for d in ds for _, b in d.received if b["prompt"] != PROMPT),
                   key=lambda b: len(b["prompt"]))
    assert [len(b["prompt"]) - len(PROMPT) for b in conts] == [3, 6]
    assert [b["max_tokens"] for b in conts] == [7, 4]
    assert [b.get("min_tokens") for b in conts] == [5, 2]
    assert metric(app, "kvferry_router_migrations_total", result="ok") == 2
    assert metric(app, "kvferry_router_migrated_tokens_total") == 3 + 6


def test_no_engine_left_is_an_error_event_then_done(fleet) -> None:
    url, _, [d], app = fleet(n_d=1)
    d.break_after = 4
    events, _ = stream(url, {"prompt": PROMPT, "max_tokens": 12})
    assert tokens_of(events) == greedy(PROMPT, 4)
    err = events[-1]["error"]
    assert "could not continue after 4 tokens: no decode engine left" in err["message"]
    assert err["type"] == "upstream_error"
    assert metric(app, "kvferry_router_migrations_total", result="no_engine") == 1
    assert metric(app, "kvferry_router_errors_total", endpoint="completions", leg="decode",
                  kind="transport") == 1


@pytest.mark.parametrize("extra", [{"n": 2}, {"stop": ["t1"]}, {"echo": True}])
def test_unsupported_requests_end_with_the_error(fleet, extra: dict[str, Any]) -> None:
    url, _, ds, app = fleet()
    ds[0].break_after = 3
    events, _ = stream(url, {"prompt": PROMPT, "max_tokens": 12, **extra})
    assert "cannot continue on another engine" in events[-1]["error"]["message"]
    assert "return_token_ids" not in ds[0].received[0][1]
    assert sum(len(d.received) for d in ds) == 1
    assert metric(app, "kvferry_router_migrations_total", result="unsupported") == 1


def test_migration_off(fleet) -> None:
    url, _, ds, app = fleet(max_migrations=0)
    ds[0].break_after = 3
    events, _ = stream(url, {"prompt": PROMPT, "max_tokens": 12})
    assert "migration off" in events[-1]["error"]["message"]


def test_break_before_any_event_resends_the_request(fleet) -> None:
    url, _, ds, _ = fleet()
    ds[0].break_after = 0
    messages = [{"role": "user", "content": "again"}]
    events, _ = stream(url, {"messages": messages, "max_tokens": 6}, chat=True)
    assert tokens_of(events) == greedy(render(messages), 6)
    assert [path for d in ds for path, _ in d.received] == ["chat", "chat"]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"


def test_migrated_turn_commits_on_the_new_decoder(fleet) -> None:
    url, _, ds, app = fleet(decode_control_addrs=["127.0.0.1:1", "127.0.0.1:2"],
                            connect_timeout_s=0.2)
    ds[0].break_after = 5
    ds[0].lease_offer = ds[1].lease_offer = True
    events, raw = stream(url, {"prompt": PROMPT, "max_tokens": 8, "conversation_id": "c1"},
                         headers=AUTH)
    assert tokens_of(events) == greedy(PROMPT, 8) and b"kv_transfer_params" not in raw
    new = ds[1]
    asked = [b["kv_transfer_params"]["lease"]["lease_id"] for d in ds for _, b in d.received]
    assert len(set(asked)) == 2  # the continuation asked a lease of its own
    _, entry = app.state.conversations.lookup("c1", AUTH)
    assert entry is not None and entry.engine_id == new.name
    assert entry.lease_id == new.received[0][1]["kv_transfer_params"]["lease"]["lease_id"]


# -- the pure part -----------------------------------------------------------------------
def test_unsupported_reasons() -> None:
    ok = {"stream": True, "prompt": PROMPT}
    assert resume_request.unsupported(COMPLETIONS, ok) is None
    assert resume_request.unsupported(COMPLETIONS, {**ok, "prompt": "text"}) is None
    assert resume_request.unsupported(CHAT, {"stream": True, "messages": []}) is None
    cases = [(COMPLETIONS, {**ok, "stream": False}, "not a stream"),
             (COMPLETIONS, {**ok, "prompt": [PROMPT, PROMPT]}, "several prompts"),
             (COMPLETIONS, {**ok, "best_of": 3}, "best_of > 1"),
             (COMPLETIONS, {**ok, "response_format": {"type": "json_object"}},
              "response_format"),
             (CHAT, {"stream": True, "tools": [{}]}, "tools"),
             (CHAT, {"stream": True, "logprobs": True}, "chat logprobs")]
    for endpoint, body, why in cases:
        assert resume_request.unsupported(endpoint, body) == why


def test_continuation_bodies() -> None:
    p = resume_request.Progress(COMPLETIONS, want_ids=False, prompt_ids=[1, 2], sent=[3, 4, 5])
    body = {"prompt": "ab", "stream": True, "temperature": 0, "logprobs": 2, "echo": False,
            "prompt_logprobs": 1, "min_tokens": 2}
    cont = resume_request.continuation_body(p, body)
    assert cont == {"prompt": [1, 2, 3, 4, 5], "stream": True, "temperature": 0,
                    "logprobs": 2, "max_tokens": 16 - 3, "return_token_ids": True}
    assert resume_request.continuation_body(p, {**body, "max_tokens": None})["max_tokens"] is None
    assert resume_request.continuation_body(p, {**body, "max_tokens": 3}) is None  # nothing left
    chat = resume_request.Progress(CHAT, want_ids=True, prompt_ids=[9], sent=[8])
    cont = resume_request.continuation_body(chat, {"messages": [{"role": "user", "content": "x"}],
                                           "max_completion_tokens": 5, "max_tokens": 50,
                                           "seed": 3, "tools": None, "model": "m"})
    assert cont == {"model": "m", "seed": 3, "max_tokens": 4, "prompt": [9, 8],
                    "stream": True, "return_token_ids": True}


def test_rewriter_holds_partial_events_and_shifts_offsets() -> None:
    p = resume_request.Progress(COMPLETIONS, want_ids=False)
    first = resume.EventRewriter(p)
    ev = (b'data: {"id":"a","created":1,"choices":[{"index":0,"text":"ab","token_ids":[5],'
          b'"prompt_token_ids":[1,2]}]}\n\n')
    out = b"".join(first.feed(ev[i:i + 7]) for i in range(0, len(ev), 7))
    assert json.loads(out[6:])["choices"][0] == {"index": 0, "text": "ab", "token_ids": None,
                                                  "prompt_token_ids": None}
    assert (p.sent, p.prompt_ids, p.text_chars, first.broken()) == (
        [5], [1, 2], 2, "ended before [DONE]")
    cont = resume.EventRewriter(p, offset=1)
    out = cont.feed(b'data: {"id":"b","created":2,"choices":[{"index":0,"text":"cd",'
                    b'"logprobs":{"text_offset":[0,1]},"token_ids":[6,7]}],'
                    b'"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\ndata: [DONE]\n\n')
    obj = json.loads(out.split(b"\n\n")[0][6:])
    assert obj["id"] == "a" and obj["created"] == 1
    assert obj["choices"][0]["logprobs"]["text_offset"] == [2, 3]
    assert obj["usage"] == {"prompt_tokens": 2, "completion_tokens": 3}
    assert p.sent == [5, 6, 7] and cont.broken() is None


# -- first token from P (router/legs/first_token.py) ----------------------------------------------
PUSH_KV = {"prefill_kv_addrs": ["127.0.0.1:5600"]}
PUSH_HDR = {"x-kvferry-mode": "push"}


def timed_stream(url: str, body: dict[str, Any], chat: bool = False,
                 headers: dict[str, str] | None = None,
                 on_first: threading.Event | None = None) -> tuple[list[dict[str, Any]], float]:
    """The stream's events and when its first event arrived (perf_counter); `on_first`
    is set when the client has it."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    first_at = None
    raw = b""
    with httpx.stream("POST", url + path, json={"model": "fake", "stream": True, **body},
                      headers={**PUSH_HDR, **(headers or {})}, timeout=20,
                      trust_env=False) as r:
        assert r.status_code == 200
        for chunk in r.iter_bytes():
            if first_at is None and b"data: {" in chunk:
                first_at = time.perf_counter()
                if on_first is not None:
                    on_first.set()
            raw += chunk
    assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"[DONE]") == 1 and first_at
    return [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")], first_at


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("burst", [1, 3])
@pytest.mark.parametrize("want_ids", [False, True])
def test_push_first_token_from_prefill(fleet, chat: bool, burst: int, want_ids: bool) -> None:
    """A greedy push stream gets P's token 1 before D's first event; D's own token 1 is
    dropped (from an event of several tokens too), so the client sees every token once,
    under one id, as an uninterrupted run."""
    url, p, ds, app = fleet(n_d=1, first_token_chat=True, **PUSH_KV)
    # D's first step comes only once the client has an event: the router must send P's
    # token without waiting for D (a fixed delay would race P's answer on a busy machine)
    ds[0].first_gate = threading.Event()
    ds[0].burst = burst
    msgs = [{"role": "user", "content": "hi"}]
    body = ({"messages": msgs, "max_completion_tokens": 6} if chat else
            {"prompt": PROMPT, "max_tokens": 6})
    events, first_at = timed_stream(url, {**body, "temperature": 0,
                                          **({"return_token_ids": True} if want_ids else {})},
                                    chat, on_first=ds[0].first_gate)
    assert first_at < ds[0].first_event_at  # P's token 1 reached the client first
    events = [e for e in events if e.get("id")]  # not push's report event
    want = greedy(render(msgs) if chat else PROMPT, 6)
    assert tokens_of(events) == want
    assert {e["id"] for e in events} == {"p-answer"} and {e["created"] for e in events} == {999}
    choices = [c for e in events for c in e["choices"]]
    if want_ids:  # each token's id once, the prompt's once, in the first event
        assert [t for c in choices for t in c.get("token_ids") or []] == want
        prompts = [x for e in events for x in (e, *e["choices"]) if x.get("prompt_token_ids")]
        assert len(prompts) == 1 and prompts[0] in (events[0], events[0]["choices"][0])
    else:
        assert all(c.get("token_ids") is None and c.get("prompt_token_ids") is None
                   for c in choices)  # the client asked for none
    if chat:
        assert choices[0]["delta"]["role"] == "assistant"
        assert sum(1 for c in choices if c["delta"].get("role")) == 1  # D's role event dropped
    assert choices[-1]["finish_reason"] == "length"
    [(_, pb)] = p.received
    assert pb["return_token_ids"] is True and pb["max_tokens"] == 1
    assert metric(app, "kvferry_router_first_token_total", result="sent") == 1
    assert metric(app, "kvferry_router_first_token_total", result="spliced") == 1
    assert metric(app, "kvferry_router_migrations_total", result="ok") == 0


def test_push_first_token_mismatch_continues_from_p_token(fleet) -> None:
    """D's token 1 is not P's (a near-tie): the client keeps P's token, and the stream goes
    on from prompt + that token, on the same D (it is not broken)."""
    url, p, ds, app = fleet(n_d=1, **PUSH_KV)
    p.token_one_shift = 1
    ds[0].first_gate = threading.Event()  # D steps once the client has P's token
    events, _ = timed_stream(url, {"prompt": PROMPT, "max_tokens": 6, "temperature": 0},
                             on_first=ds[0].first_gate)
    t1 = greedy(PROMPT, 1)[0] + 1
    assert tokens_of(events) == [t1, *greedy(PROMPT + [t1], 5)]
    (_, first), (_, cont_p) = p.received
    assert cont_p["prompt"] == PROMPT + [t1] and cont_p["max_tokens"] == 1
    assert [path for path, _ in ds[0].received] == ["completions", "completions"]
    assert ds[0].received[1][1]["max_tokens"] == 5
    assert metric(app, "kvferry_router_first_token_total", result="mismatch") == 1
    assert metric(app, "kvferry_router_migrations_total", result="ok") == 1
    assert metric(app, "kvferry_router_upstream_healthy", role="decode",
                  upstream=app.state.pools["decode"].upstreams[0].name) == 1


@pytest.mark.parametrize("extra", [{"temperature": 0.7}, {}, {"temperature": 0, "stop": ["t"]},
                                   {"temperature": 0, "logprobs": 1},
                                   {"temperature": 0, "header": "decode"}])
def test_push_first_token_only_for_greedy_continuable_streams(fleet, extra: dict) -> None:
    """Sampling, no temperature (the model's default), stop strings, logprobs, or the
    client's `x-kvferry-first-token: decode`: D's stream as it comes."""
    url, p, ds, app = fleet(n_d=1, **PUSH_KV)
    extra = dict(extra)
    header = extra.pop("header", None)
    events, _ = timed_stream(url, {"prompt": PROMPT, "max_tokens": 4, **extra},
                             headers={"x-kvferry-first-token": header} if header else None)
    assert tokens_of(events) == greedy(PROMPT, 4)
    assert "return_token_ids" not in p.received[0][1]
    assert metric(app, "kvferry_router_first_token_total", result="sent") == 0


def test_push_first_token_later_than_d_leaves_d_stream_alone(fleet) -> None:
    """P's answer comes after the client already has D's first event (P answers only
    then: a fixed delay would race D's stream on a busy machine): D's stream as it is."""
    url, p, ds, app = fleet(n_d=1, **PUSH_KV)
    p.answer_gate = threading.Event()
    events, _ = timed_stream(url, {"prompt": PROMPT, "max_tokens": 4, "temperature": 0},
                             on_first=p.answer_gate)
    assert tokens_of(events) == greedy(PROMPT, 4)
    assert metric(app, "kvferry_router_first_token_total", result="sent") == 0
    assert metric(app, "kvferry_router_first_token_total", result="spliced") == 0
