"""No engine-owned field reaches a client through the router (pull and push, streamed and
not, chat and completions), with D's answers exactly as vLLM 0.33 serializes them: that
version puts D's `kv_transfer_params` (lease offer, block ids, host:port) on a stream's
last chunk and `"kv_transfer_params": null` on every completions chunk.

The answer bytes come from vLLM 0.33's own protocol classes (tests/vllm_answer_shapes.py,
run on the 0.33 sources that .ci/setup fetches); the router and fake engines speak real HTTP.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers_http import FakeEngine, closed_port_url, serve
from vllm_sources import source_dir

from kvferry.router.api.app import create_app
from kvferry.router.conversations.registry import ANONYMOUS
from kvferry.router.settings import RouterSettings
from kvferry.router.wire.sse_filters import EngineFieldFilter

HERE = Path(__file__).parent
LEASE = "__LEASE_ID__"
OFFER = {"lease": {"lease_id": LEASE, "engine_id": "d0-engine", "expiry": 4.0e9,
                   "num_tokens": 256, "sig": "c2VjcmV0"},
         "remote_host": "10.9.8.7", "remote_port": 5616, "remote_block_ids": [41, 42]}
SECRETS = ("kv_transfer_params", "ec_transfer_params", "10.9.8.7", "c2VjcmV0", "d0-engine")
P_PARAMS = {"do_remote_prefill": True, "remote_block_ids": [3], "remote_engine_id": "p0",
            "remote_host": "127.0.0.1", "remote_port": 5600}


@pytest.fixture(scope="module")
def shapes() -> dict[str, Any]:
    """vLLM 0.33's answer bytes for chat and completions (JSON and SSE events)."""
    src = source_dir("0.33.0")
    out = subprocess.run([sys.executable, str(HERE / "vllm_answer_shapes.py"), json.dumps(OFFER)],
                         env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=120, check=True)
    data = json.loads(out.stdout)
    assert data["vllm_file"].startswith(str(src))  # really 0.33's classes, not the venv's
    return data


def scripted_d(shapes: dict[str, Any]) -> FakeEngine:
    """A fake D that answers with 0.33's bytes, its lease offer naming the turn's lease id."""

    def script(body: dict[str, Any], chat: bool) -> tuple[str, list[bytes]]:
        lease = ((body.get("kv_transfer_params") or {}).get("lease") or {}).get("lease_id", "x")
        shape = shapes["chat" if chat else "completions"]
        events = [f"data: {e.replace(LEASE, lease)}\n\n".encode() for e in shape["events"]]
        return shape["json"].replace(LEASE, lease), [*events, b"data: [DONE]\n\n"]

    return FakeEngine("d0", script=script)


@pytest.fixture
def router(shapes: dict[str, Any]) -> Iterator[Callable[..., tuple[str, Any]]]:
    stack = ExitStack()

    def make(**overrides: Any) -> tuple[str, Any]:
        p, d = FakeEngine("p0", kv_params=dict(P_PARAMS)), scripted_d(shapes)
        purl, durl = (stack.enter_context(serve(e.app())) for e in (p, d))
        settings = RouterSettings(prefill_urls=[purl], decode_urls=[durl],
                                  prefill_kv_addrs=["127.0.0.1:5655"], **overrides)
        app = create_app(settings)
        return stack.enter_context(serve(app)), app

    with stack:
        yield make


def text_of(raw: str, chat: bool, stream: bool) -> str:
    if not stream:
        choice = json.loads(raw)["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]
    out = []
    for line in raw.splitlines():
        if line.startswith("data:") and (payload := line[5:].strip()) != "[DONE]":
            for c in json.loads(payload)["choices"]:
                out.append((c.get("delta") or {}).get("content") or "" if chat else c["text"])
    return "".join(out)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_no_engine_field_reaches_the_client(router, mode: str, chat: bool, stream: bool) -> None:
    url, _ = router()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 3, "stream": stream,
                            "conversation_id": "c1"}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    r = httpx.post(url + path, json=body, headers={"x-kvferry-mode": mode}, timeout=30)
    assert r.status_code == 200, r.text
    for s in SECRETS:
        assert s not in r.text, f"{s!r} reached the client ({mode}, stream={stream})"
    assert text_of(r.text, chat, stream) == "Hello from D"
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_streamed_offer_commits_the_conversation(router, chat: bool) -> None:
    """0.33 streams D's lease offer: the registry takes it from the stream (D's
    lease-control address is a port where nothing listens, so nothing else supplied it)."""
    url, app = router(decode_control_addrs=[closed_port_url().removeprefix("http://")])
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": "tiny", "max_tokens": 3, "stream": True, "conversation_id": "c7",
            **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == 200 and "kv_transfer_params" not in r.text
    registry = app.state.conversations.registry
    assert len(registry) == 1  # committed before [DONE] left: a next turn sent now finds it
    entry = registry.get(ANONYMOUS, "c7", now=0.0)  # no API key: the anonymous tenant
    assert entry is not None and entry.engine_id == "d0-engine" and entry.num_tokens == 256


def test_filter_holds_partial_events_and_scrubs_at_any_split(shapes: dict[str, Any]) -> None:
    """Every split of 0.33's byte stream gives the same scrubbed output as one chunk."""
    raw = b"".join(f"data: {e}\n\n".encode() for e in shapes["completions"]["events"])
    raw += b"data: [DONE]\n\n"
    whole = EngineFieldFilter()
    expect = whole.feed(raw) + whole.flush()
    assert b"kv_transfer_params" not in expect and expect.endswith(b"data: [DONE]\n\n")
    assert whole.scrubbed == len(shapes["completions"]["events"])
    for cut in range(1, len(raw)):
        seen: list[dict] = []
        f = EngineFieldFilter(seen.append)
        got = f.feed(raw[:cut]) + f.feed(raw[cut:]) + f.flush()
        assert got == expect, cut
        assert seen and seen[0]["remote_host"] == "10.9.8.7"


def test_filter_passes_events_without_engine_fields_untouched() -> None:
    raw = b'data: {"id":"x","choices":[{"text":"kv"}]}\r\n\r\ndata: [DONE]\r\n\r\n'
    f = EngineFieldFilter()
    assert f.feed(raw) + f.flush() == raw and f.scrubbed == 0
