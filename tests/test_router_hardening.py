"""Issue 37's router items over real HTTP, fake vLLM engines (named so) and the real router:
what D would refuse is refused before P works (2), P is told to free an offer no D will
read (2), clients see no engine identity (3), router API keys (4), push streams carry only
events vLLM could send (5), body size limit (6), metrics (7)."""

from __future__ import annotations

import contextvars
import json
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
from helpers_http import OPERATOR, FakeEngine, closed_port_url, free_port, serve
from helpers_sse import strict_events
from prometheus_client.parser import text_string_to_metric_families

from kvferry.connectors.protocol import send_release
from kvferry.connectors.protocol.lease_control import Refused
from kvferry.connectors.protocol.params import SIG
from kvferry.connectors.transfer.handshake import HandshakeServer
from kvferry.connectors.transfer.results import ResultBox
from kvferry.connectors.transfer.sends import Sends
from kvferry.connectors.transfer.stats import Stats
from kvferry.router.api.app import create_app
from kvferry.router.settings import RouterSettings
from kvferry.router.wire.headers import OPERATOR_HEADERS, parse_report_comment

KEY = b"hardening-secret"
KV_ADDR = "127.0.0.1:5650"


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as es:
        yield es


def vllm_script(name: str) -> Callable[[dict[str, Any], bool], tuple[bytes, list[bytes]]]:
    """A FAKE engine's answers shaped as vLLM's: every chunk has id, object, created,
    model and a choice; with stream_options.include_usage a last chunk of usage and no
    choices."""

    def script(body: dict[str, Any], chat: bool) -> tuple[bytes, list[bytes]]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": f"{name}-1", "object": obj, "created": 1, "model": body["model"]}

        def choice(text: str, last: bool) -> dict[str, Any]:
            c: dict[str, Any] = {"index": 0, "logprobs": None,
                                 "finish_reason": "stop" if last else None}
            if chat:
                c["delta"] = {"content": text}
            else:
                c["text"] = text
            return c

        events = [{**head, "choices": [choice(f"t{i} ", i == 2)]} for i in range(3)]
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({**head, "choices": [], "usage": {
                "prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}})
        sse = [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]
        answer = {"id": f"{name}-1", "object": "chat.completion" if chat else "text_completion",
                  "created": 1, "model": body["model"], "choices": [{
                      "index": 0, "finish_reason": "stop",
                      **({"message": {"role": "assistant", "content": "t0 t1 t2"}} if chat
                         else {"text": "t0 t1 t2"})}],
                  "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}}
        return json.dumps(answer).encode(), sse

    return script


def start(stack: ExitStack, p_params: dict[str, Any] | None = None, **kw: Any
          ) -> tuple[str, FakeEngine, FakeEngine, Any]:
    p = FakeEngine("p0", kv_params=p_params or {"remote_block_ids": [1], "remote_engine_id": "p0"})
    d = FakeEngine("d0")
    d.script = vllm_script("d0")
    purl, durl = (stack.enter_context(serve(e.app())) for e in (p, d))
    kw.setdefault("health_interval_s", 0)
    app = create_app(RouterSettings(prefill_urls=[purl], decode_urls=[durl], **kw), KEY)
    return stack.enter_context(serve(app)), p, d, app


def metric(url: str, name: str, **labels: str) -> float | None:
    text = httpx.get(url + "/metrics", trust_env=False).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
         path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers, timeout=10, trust_env=False)


BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 3}


# -- item 2: validated before P, and P's offer freed when D refuses ---------------------

@pytest.mark.parametrize(("path", "fields"), [
    ("/v1/completions", {"max_tokens": 0}),
    ("/v1/completions", {"max_tokens": -5}),
    ("/v1/completions", {"max_tokens": 1.5}),
    ("/v1/completions", {"max_tokens": "many"}),
    ("/v1/completions", {"n": -1}),
    ("/v1/completions", {"n": 0}),
    ("/v1/completions", {"n": 20000}),
    ("/v1/completions", {"min_tokens": 5, "max_tokens": 2}),
    ("/v1/completions", {"min_tokens": -1}),
    ("/v1/completions", {"logprobs": -3}),
    ("/v1/completions", {"stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"max_completion_tokens": 0}),
    ("/v1/chat/completions", {"max_tokens": -1}),
])
def test_what_decode_would_refuse_is_400_before_any_prefill(
        stack: ExitStack, path: str, fields: dict[str, Any]) -> None:
    url, p, d, _ = start(stack)
    body = ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
            if "chat" in path else {"model": "tiny", "prompt": "hi"})
    r = post(url, {**body, **fields}, path=path)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert p.received == [] and d.received == []
    assert metric(url, "kvferry_router_errors_total", endpoint="chat" if "chat" in path
                  else "completions", leg="router", kind="invalid_request") == 1


def test_what_vllm_accepts_still_goes_through(stack: ExitStack) -> None:
    """vLLM's request models are lax: 2.0 and "2" are 2; a large max_tokens is clamped by
    vLLM 0.32+ (it refuses only on engines that refuse it: validate.EngineLimits)."""
    url, p, d, _ = start(stack)
    for fields in ({"max_tokens": 2.0}, {"max_tokens": "2"}, {"n": 1},
                   {"max_tokens": 10**9}, {"stream": True,
                                           "stream_options": {"include_usage": True}}):
        assert post(url, {**BODY, **fields}).status_code == 200, fields
    assert len(p.received) == len(d.received) == 5


def signed_offer(port: int, req_id: str) -> dict[str, Any]:
    """A kvferry pull offer as P returns it (the router only reads its address and id)."""
    return {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_host": "127.0.0.1",
            "remote_port": port, "remote_block_ids": [1, 2], "remote_request_id": req_id,
            "remote_num_tokens": 20, "remote_tp_size": 1, "transfer_id": "t", SIG: "0" * 64}


class PSideChannel:
    """P's real side channel (HandshakeServer) and real `Sends`, wired as P's transfer
    worker wires them, without NIXL: the router's release frees an offer's blocks."""

    def __init__(self, es: ExitStack, key: bytes) -> None:
        self.port = free_port()
        self.out = ResultBox()
        self.sends = Sends(self.out, 120.0, Stats("p0", 0))
        self.server = HandshakeServer("127.0.0.1", self.port, {"engine_id": "p0"})
        es.callback(self.server.close)
        self.refused: list[str] = []
        self.requests: list[send_release.ReleaseSend] = []

        def on_release(blob: bytes) -> bytes:
            try:
                req = send_release.parse(blob, key)
            except Refused as e:
                self.refused.append(e.reason)
                return send_release.reply(False, e.reason)
            self.requests.append(req)
            if not req.transfer_id:  # push: the worker hands it to push_write as an Abort
                self.sends.release(req.req_id, time.monotonic())
            return send_release.reply(True)

        self.server.on_release = on_release

    def freed(self, timeout_s: float = 2.0) -> set[str]:
        return self.out.take(timeout_s).sent


def test_decode_refusal_frees_prefills_offer_at_once(stack: ExitStack) -> None:
    """D refuses what the router cannot check (here: its own 400): P's blocks are freed
    now, not after send_timeout_s."""
    side = PSideChannel(stack, KEY)
    url, p, d, _ = start(stack, signed_offer(side.port, "cmpl-p-1"))
    side.sends.hold(["cmpl-p-1"], time.monotonic())  # P published the offer
    d.status = 400
    t0 = time.monotonic()
    r = post(url, BODY)
    assert r.status_code == 400 and len(p.received) == 1
    assert side.freed() == {"cmpl-p-1"} and time.monotonic() - t0 < 2.0
    assert metric(url, "kvferry_router_offers_released_total", result="ok") == 1


def test_decode_down_frees_prefills_offer_and_a_forged_release_frees_nothing(
        stack: ExitStack) -> None:
    side = PSideChannel(stack, KEY)
    p = FakeEngine("p0", kv_params=signed_offer(side.port, "cmpl-p-2"))
    purl = stack.enter_context(serve(p.app()))
    app = create_app(RouterSettings(prefill_urls=[purl], decode_urls=[closed_port_url()],
                                    health_interval_s=0), KEY)
    url = stack.enter_context(serve(app))
    side.sends.hold(["cmpl-p-2"], time.monotonic())
    assert post(url, BODY).status_code == 502
    assert side.freed() == {"cmpl-p-2"}
    # Only a holder of the deployment secret may free P's blocks.
    side.sends.hold(["cmpl-p-3"], time.monotonic())
    reply = msgspec.msgpack.decode(_ask(side.port, send_release.request("cmpl-p-3", b"wrong")))
    assert reply == {"ok": False, "error": "bad_signature"} and side.freed(0.3) == set()


@pytest.mark.parametrize("stream", [False, True])
def test_push_decode_refusal_aborts_the_transfer_on_prefill(stack: ExitStack, stream: bool
                                                            ) -> None:
    """Push: D refused the leg, so no D will register for the transfer: P is told at once
    (as D's own Abort), instead of holding what it prefilled push_hold_timeout_s."""
    side = PSideChannel(stack, KEY)
    url, p, d, _ = start(stack, prefill_kv_addrs=[f"127.0.0.1:{side.port}"], mode="push")
    d.status = 400
    r = post(url, {**BODY, "stream": stream}, OPERATOR)
    assert r.status_code == 400
    tid = r.headers["x-kvferry-transfer-id"]
    deadline = time.monotonic() + 2
    while not side.requests:
        assert time.monotonic() < deadline, "P was not told"
        time.sleep(0.02)
    assert [q.transfer_id for q in side.requests] == [tid] and side.refused == []
    assert metric(url, "kvferry_router_offers_released_total", result="ok") == 1


def _ask(port: int, blob: bytes) -> bytes:
    from kvferry.connectors.transfer.handshake import request

    return request("127.0.0.1", port, blob, 2.0, "release")


# -- item 3: engine identity only for the operator --------------------------------------

def test_clients_see_no_engine_identity_operators_do(stack: ExitStack) -> None:
    url, _, _, _ = start(stack, prefill_kv_addrs=[KV_ADDR])
    for mode in ("pull", "push"):
        for stream in (False, True):
            body = {**BODY, "stream": stream}
            r = post(url, body, {"x-kvferry-mode": mode})
            assert r.status_code == 200
            assert not set(OPERATOR_HEADERS) & set(r.headers), (mode, stream, r.headers)
            assert "kvferry_prefill_ms" not in r.text
            r = post(url, body, {"x-kvferry-mode": mode, **OPERATOR})
            assert r.headers["x-kvferry-decode"].startswith("http://127.0.0.1:")
            assert r.headers["x-kvferry-prefill"].startswith("http://127.0.0.1:")
            assert len(r.headers["x-kvferry-transfer-id"]) == 32
    models = httpx.get(url + "/v1/models", trust_env=False)
    assert models.status_code == 200 and "x-kvferry-decode" not in models.headers
    assert httpx.get(url + "/health", trust_env=False).json() == {"status": "ok"}
    assert httpx.get(url + "/health?deep=true", trust_env=False).status_code == 403
    wrong = {"x-kvferry-operator-token": "guess"}
    assert httpx.get(url + "/health?deep=true", headers=wrong, trust_env=False
                     ).status_code == 403
    deep = httpx.get(url + "/health?deep=true", headers=OPERATOR, trust_env=False).json()
    assert deep["status"] == "ok" and deep["prefill"][0]["healthy"] is True
    assert deep["decode"][0]["url"].startswith("http://127.0.0.1:")
    assert (deep["prefill"][0]["name"], deep["decode"][0]["name"]) == ("prefill-0", "decode-0")
    # /metrics is on the client port too: engines appear by name, never by address
    text = httpx.get(url + "/metrics", trust_env=False).text
    assert 'upstream="decode-0"' in text and 'upstream="prefill-0"' in text
    assert "127.0.0.1" not in text and "http://" not in text


def test_error_messages_name_no_engine(stack: ExitStack) -> None:
    durl = stack.enter_context(serve(FakeEngine("d0").app()))
    dead = closed_port_url()
    url = stack.enter_context(serve(create_app(RouterSettings(
        prefill_urls=[dead], decode_urls=[durl], health_interval_s=0), KEY)))
    r = post(url, BODY)
    assert r.status_code == 502 and "127.0.0.1" not in r.text and "<engine>" in r.text


# -- item 4: router API keys ----------------------------------------------------------

def test_api_keys_401_before_any_engine_work_and_rotation_without_restart(
        stack: ExitStack, tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"team-a": "sk-a-1", "team-b": "sk-b-1"}))
    url, p, d, _ = start(stack, api_keys_file=str(keys))
    for headers in ({}, {"authorization": "Bearer nope"}, {"x-api-key": "sk-a"}):
        r = post(url, BODY, headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/v1/models", trust_env=False).status_code == 401
    assert httpx.get(url + "/v1/kvferry/conversations/c1", trust_env=False).status_code == 401
    assert p.received == [] and d.received == []
    assert post(url, BODY, {"authorization": "Bearer sk-a-1"}).status_code == 200
    assert post(url, BODY, {"x-api-key": "sk-b-1"}).status_code == 200
    assert httpx.get(url + "/health", trust_env=False).status_code == 200  # no key needed
    # Rotation: team-a's key changes in the file; the router follows without a restart.
    keys.write_text(json.dumps({"team-a": "sk-a-2", "team-b": "sk-b-1"}))
    deadline = time.monotonic() + 5
    while post(url, BODY, {"authorization": "Bearer sk-a-1"}).status_code != 401:
        assert time.monotonic() < deadline, "the rotated-out key still works"
        time.sleep(0.2)
    assert post(url, BODY, {"authorization": "Bearer sk-a-2"}).status_code == 200
    # A broken file keeps the last good keys (neither locks everyone out nor lets all in).
    keys.write_text("{not json")
    time.sleep(1.2)
    assert post(url, BODY, {"authorization": "Bearer sk-a-2"}).status_code == 200
    assert post(url, BODY).status_code == 401


def test_tenant_is_the_keys_id(tmp_path: Path) -> None:
    """The conversation tenant follows the key's id: a rotated key keeps the tenant's
    conversations, another id is another tenant."""
    from kvferry.router.api import auth
    from kvferry.router.conversations.caller import caller_key
    from kvferry.router.conversations.registry import tenant_of

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"team-a": "sk-a-1"}))
    gate = auth.Gate(auth.ApiKeys(str(keys)), None)

    def tenant(key: str) -> str:
        """As one request sees it: its own context (the router's requests each run in
        one), so the caller set here does not outlive it."""
        headers = {"authorization": f"Bearer {key}"}

        def request() -> str:
            assert gate.admit(headers) is None
            return tenant_of(caller_key(headers), KEY)

        return contextvars.copy_context().run(request)

    before = tenant("sk-a-1")
    keys.write_text(json.dumps({"team-a": "sk-a-rotated", "team-b": "sk-b"}))
    gate.keys._checked = 0.0  # noqa: SLF001 - skip the 1 s between looks at the file
    assert tenant("sk-a-rotated") == before != tenant("sk-b")


# -- item 5: push streams: only events vLLM could send -----------------------------------

@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_streams_carry_only_vllms_events(stack: ExitStack, mode: str, chat: bool, usage: bool
                                         ) -> None:
    url, p, d, _ = start(stack, prefill_kv_addrs=[KV_ADDR], mode=mode)
    kw: dict[str, Any] = {"stream_options": {"include_usage": True}} if usage else {}
    sdk = openai.OpenAI(base_url=url + "/v1", api_key="k", default_headers=OPERATOR,
                        http_client=httpx.Client(trust_env=False))
    if chat:
        chunks = list(sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
            stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        chunks = list(sdk.completions.create(model="tiny", prompt="hi", max_tokens=3,
                                             stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "t0 t1 t2 "
    assert all(c.id == "d0-1" for c in chunks)
    assert [c.usage is not None for c in chunks if not c.choices] == ([True] if usage else [])
    # The raw bytes, as a strict parser reads them; the operator's report is a comment.
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = ({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    r = post(url, {"model": "tiny", "max_tokens": 3, "stream": True, **body, **kw}, OPERATOR,
             path=path)
    strict_events(r.text, chat, usage, completion_tokens=3)
    reports = [x for ln in r.text.splitlines() if (x := parse_report_comment(ln)) is not None]
    if mode == "push":  # P's report rides D's stream as a comment, for the operator only
        assert len(reports) == 1 and reports[0]["kvferry_prefill_ms"] >= 0
    else:
        assert reports == []


# -- item 6: body size limit ----------------------------------------------------------

def test_body_over_the_limit_is_413_unread(stack: ExitStack) -> None:
    url, p, d, _ = start(stack, max_body_bytes=4096)
    big = {**BODY, "prompt": "x" * 5000}
    r = post(url, big)
    assert r.status_code == 413 and p.received == []

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it is read
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]

    r = httpx.post(url + "/v1/completions", content=chunked(), trust_env=False,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and p.received == []
    assert post(url, BODY).status_code == 200
    assert metric(url, "kvferry_router_errors_total", endpoint="completions", leg="router",
                  kind="too_large") == 2


def test_default_body_limit_is_sized_from_max_model_len() -> None:
    from kvferry.router.fleet.engine_limits import BODY_BYTES_PER_TOKEN, BODY_OVERHEAD, body_limit
    from kvferry.router.wire.validate import EngineLimits

    s = RouterSettings(prefill_urls=["http://p"], decode_urls=["http://d"])
    assert body_limit(s, EngineLimits(32768)) == 32768 * BODY_BYTES_PER_TOKEN + BODY_OVERHEAD
    # 16k token ids as JSON fit; 50 MB does not.
    assert len(json.dumps({"prompt": [151935] * 32768})) < body_limit(s, EngineLimits(32768))
    assert body_limit(s, EngineLimits(32768)) < 50_000_000


def test_router_learns_max_model_len_and_refuses_old_vllms_over_length(
        stack: ExitStack) -> None:
    """vLLM up to 0.26 refuses prompt + max_tokens beyond max_model_len (0.32 clamps): the
    router refuses it before P for such engines, from their /v1/models and /version."""
    from fastapi import FastAPI

    d = FakeEngine("d0")
    inner = d.app()
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": "tiny", "max_model_len": 64}]}

    @app.get("/version")
    async def version() -> Any:
        return {"version": "0.21.0"}

    app.mount("/", inner)
    p = FakeEngine("p0", kv_params={"remote_block_ids": [1]})
    purl, durl = stack.enter_context(serve(p.app())), stack.enter_context(serve(app))
    router_app = create_app(RouterSettings(prefill_urls=[purl], decode_urls=[durl],
                                           health_interval_s=0), KEY)
    url = stack.enter_context(serve(router_app))
    deadline = time.monotonic() + 5
    while router_app.state.limits.known.max_model_len != 64:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = post(url, {"model": "tiny", "prompt": list(range(60)), "max_tokens": 10})
    assert r.status_code == 400 and "maximum context length is 64" in r.json()["error"]["message"]
    assert p.received == []
    assert post(url, {"model": "tiny", "prompt": list(range(50)), "max_tokens": 10}
                ).status_code == 200


# -- item 7: metrics ----------------------------------------------------------------

def test_upstream_answers_by_code_and_leg_and_end_to_end_latency(stack: ExitStack) -> None:
    url, p, d, _ = start(stack)
    assert post(url, BODY).status_code == 200
    assert post(url, {**BODY, "stream": True}).status_code == 200
    d.status = 400
    assert post(url, BODY).status_code == 400
    assert metric(url, "kvferry_router_upstream_answers_total", leg="prefill", code="200") == 3
    assert metric(url, "kvferry_router_upstream_answers_total", leg="decode", code="200") == 2
    assert metric(url, "kvferry_router_upstream_answers_total", leg="decode", code="400") == 1
    assert metric(url, "kvferry_router_request_seconds_count", endpoint="completions",
                  code="200") == 2
    assert metric(url, "kvferry_router_request_seconds_count", endpoint="completions",
                  code="400") == 1


def test_engines_start_as_starting_not_ejected(stack: ExitStack) -> None:
    """Engines load for tens of seconds while the router is up in two: until an engine
    first answers, it is "starting", and its failed probes eject nothing."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    up = {"ready": False}
    d = FakeEngine("d0")
    inner = d.app()
    app = FastAPI()

    @app.get("/health")
    async def health() -> Any:
        return JSONResponse({}, status_code=200 if up["ready"] else 503)

    app.mount("/", inner)
    p = FakeEngine("p0", kv_params={"remote_block_ids": [1]})
    purl, durl = stack.enter_context(serve(p.app())), stack.enter_context(serve(app))
    url = stack.enter_context(serve(create_app(RouterSettings(
        prefill_urls=[purl], decode_urls=[durl], health_interval_s=0.05, eject_after=2), KEY)))

    def state() -> str:
        return httpx.get(url + "/health", headers=OPERATOR, trust_env=False
                         ).json()["decode"][0]["state"]

    time.sleep(0.5)  # ten probes failed
    assert state() == "starting"
    assert metric(url, "kvferry_router_upstream_healthy", role="decode", upstream="decode-0") == 0
    up["ready"] = True
    deadline = time.monotonic() + 5
    while state() != "healthy":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert metric(url, "kvferry_router_ejections_total", role="decode", upstream="decode-0") is None
    assert metric(url, "kvferry_router_readmissions_total", role="decode", upstream="decode-0") is None
    assert metric(url, "kvferry_router_upstream_healthy", role="decode", upstream="decode-0") == 1


def test_k8s_launch_turns_router_keys_on(tmp_path: Path) -> None:
    """`launch --target k8s`: the router reads its API keys from a mounted Secret (rotated
    by editing it) and its operator token from the deployment Secret."""
    from kvferry.router.api.auth import ApiKeys
    from kvferry.scripts.k8s import API_KEYS_DIR, manifests
    from kvferry.scripts.k8s_settings import K8sSettings

    objs = [o for m in manifests(K8sSettings("p5en.48xlarge", "m", tp=8), "s3cret")
            for o in m.objects]
    router = next(o for o in objs if o["kind"] == "Deployment"
                  and o["metadata"]["name"] == "kvferry-router")["spec"]["template"]["spec"]
    c = router["containers"][0]
    argv = c["command"]
    assert argv[argv.index("--api-keys-file") + 1] == f"{API_KEYS_DIR}/keys.json"
    assert {"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True} in c["volumeMounts"]
    assert {"name": "api-keys", "secret": {"secretName": "kvferry-api-keys"}} in router["volumes"]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in c["env"]}
    assert env["KVFERRY_OPERATOR_TOKEN"] == "OPERATOR_TOKEN"
    secrets = {o["metadata"]["name"]: o["stringData"] for o in objs if o["kind"] == "Secret"}
    assert len(secrets["kvferry-secret"]["OPERATOR_TOKEN"]) == 64
    (tmp_path / "keys.json").write_text(secrets["kvferry-api-keys"]["keys.json"])
    key = json.loads(secrets["kvferry-api-keys"]["keys.json"])["default"]
    assert ApiKeys(str(tmp_path / "keys.json")).key_id(key) == "default"
