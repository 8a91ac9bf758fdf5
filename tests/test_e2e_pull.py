"""Pull end to end: two real vLLM CPU engines with kvferry's connector, the router, real
NIXL (UCX) transfers, real HTTP.

Reference ("colocated") outputs come from the prefill engine serving the whole request
itself; the weights are generated deterministically, so both engines hold the same model.
"""

from __future__ import annotations

import signal
import time
from contextlib import ExitStack

import httpx
import msgspec
import pytest
from helpers_http import closed_port_url, serve
from helpers_sse import strict_events
from shared_stacks import PD, shared
from stack import (
    ROUTERS,
    assert_no_engine_fields,
    assert_same_output,
    complete,
    free_port,
    outputs_differ,
    prompt,
    wait_until,
    with_router,
)

from kvferry.connectors.detokenizer_window import DEFAULT_WINDOW
from kvferry.connectors.detokenizer_window import METRIC as WINDOW_METRIC
from kvferry.connectors.protocol.params import RemotePrefill, prompt_hash, sign
from kvferry.router.api.app import create_app
from kvferry.router.settings import RouterSettings

# The "pd" pair with test_e2e_push.py; last, since its last test kills P.
pytestmark = [pytest.mark.engine, pytest.mark.shared_stack("pd", last=True)]

# CPU engines use 128-token blocks: one partial block, block edges, many blocks.
LENGTHS = (3, 127, 128, 129, 700, 2100)
EXTRA = PD.extra


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # No conversations here: a chat request without an id is not leased on D (every block
    # must be free after each test), which content reuse would do.
    s = shared("pd", PD, tmp_path_factory)
    with ExitStack() as es:
        yield with_router(es, s, {"content_reuse": False})


def offer_for(stack, toks: list[int]) -> dict:
    """P's real offer for ``toks`` (the router's first leg, done by hand)."""
    r = httpx.post(stack.prefill.url + "/v1/completions", timeout=120, json={
        "model": stack.model, "prompt": toks, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "t"}})
    r.raise_for_status()
    params = r.json()["kv_transfer_params"]
    assert params and params["remote_num_tokens"] == len(toks)
    return params


def forge(params: dict, secret: str, **changes) -> dict:
    """A validly signed offer with some fields changed (what a deployment insider could do)."""
    fields = {k: v for k, v in params.items() if k in RemotePrefill.__struct_fields__}
    return sign(msgspec.convert({**fields, **changes}, RemotePrefill), secret.encode())



def test_pd_output_equals_colocated(stack):
    for n in LENGTHS:
        toks = prompt(n, seed=n)
        want = complete(stack.prefill.url, stack.model, toks)
        before = stack.decode.transferred_tokens()
        got = complete(stack.router, stack.model, toks)
        assert_same_output(got, want)
        assert stack.decode.transferred_tokens() - before == n, "D must load every prompt token"
    wait_until(lambda: stack.prefill.kv_usage() == 0, 30, "P to free all blocks after D's reads")
    assert stack.decode.kv_usage() == 0


def test_streams_carry_only_vllms_events(stack):
    """Chat and completions streams through the router from real engines, with usage asked
    for and not: every event one vLLM could send, the usage chunk last (helpers_sse)."""
    messages = [{"role": "user", "content": "Tell me about the ferry. " * 10}]
    for chat in (False, True):
        for usage in (False, True):
            body = {"model": stack.model, "max_tokens": 5, "temperature": 0, "stream": True,
                    **({"messages": messages} if chat else {"prompt": prompt(300, 40)}),
                    **({"stream_options": {"include_usage": True}} if usage else {})}
            path = "/v1/chat/completions" if chat else "/v1/completions"
            r = httpx.post(stack.router + path, json=body, timeout=120)
            assert r.status_code == 200, r.text
            events = strict_events(r.text, chat, usage, completion_tokens=5)
            assert len({ev["id"] for ev in events}) == 1
    wait_until(lambda: stack.prefill.kv_usage() == 0, 30, "P to free all blocks after D's reads")


def test_chat_stream_through_router(stack):
    messages = [{"role": "user", "content": "Tell me about the ferry that carries KV blocks. " * 20}]
    body = {"model": stack.model, "messages": messages, "max_tokens": 16, "temperature": 0}
    want = httpx.post(stack.prefill.url + "/v1/chat/completions", json=body, timeout=120).json()
    before = stack.decode.transferred_tokens()
    text = ""
    with httpx.stream("POST", stack.router + "/v1/chat/completions", timeout=120,
                      json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            assert_no_engine_fields(line)
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in msgspec.json.decode(line[6:])["choices"]:
                    text += ch.get("delta", {}).get("content") or ""
    assert text == want["choices"][0]["message"]["content"]
    assert stack.decode.transferred_tokens() - before == want["usage"]["prompt_tokens"]
    # both API servers streamed with their detokenizers primed with the prompt's tail
    assert want["usage"]["prompt_tokens"] > DEFAULT_WINDOW
    for engine in (stack.prefill, stack.decode):
        assert engine.metric(WINDOW_METRIC) == DEFAULT_WINDOW


def test_wrong_kv_is_caught(stack):
    """Negative control: D fed another prompt's blocks must produce different outputs."""
    a, b = prompt(600, 101), prompt(600, 102)
    want = complete(stack.prefill.url, stack.model, a)
    offer_b = offer_for(stack, b)
    wrong = forge(offer_b, stack.secret, remote_num_tokens=len(a), prompt_hash=prompt_hash(a))
    before = stack.decode.transferred_tokens()
    got = complete(stack.decode.url, stack.model, a, kv_transfer_params=wrong)
    assert stack.decode.transferred_tokens() - before == len(a)
    assert outputs_differ(got, want), "reading the wrong KV went unnoticed"


def test_bad_offers_recompute_without_leaks(stack):
    toks = prompt(500, 7)
    want = complete(stack.prefill.url, stack.model, toks)
    good = offer_for(stack, toks)
    unsigned = {k: v for k, v in good.items() if k != "kvferry_sig"}
    cases = {
        "unsigned": unsigned,
        "tampered": {**good, "remote_block_ids": [b + 1 for b in good["remote_block_ids"]]},
        "malformed": {"do_remote_prefill": True, "remote_block_ids": "all", "kvferry_sig": "x"},
        "other prompt": offer_for(stack, prompt(500, 8)),
        "unknown engine": forge(good, stack.secret, remote_engine_id="no-such-engine"),
        "out-of-range blocks": forge(good, stack.secret, remote_engine_id=good["remote_engine_id"],
                                     remote_block_ids=[10**6 + i for i in range(4)]),
        "P unreachable": forge(good, stack.secret, remote_engine_id="gone", remote_port=free_port()),
    }
    for name, params in cases.items():
        t0 = time.monotonic()
        got = complete(stack.decode.url, stack.model, toks, kv_transfer_params=params, timeout=60)
        assert_same_output(got, want), name
        assert time.monotonic() - t0 < 30, f"{name}: took {time.monotonic() - t0:.1f}s"
    # Every block P kept for these offers is freed: by D's release notice or P's timeout.
    wait_until(lambda: stack.prefill.kv_usage() == 0, EXTRA["send_timeout_s"] + 15, "P's blocks freed")
    assert stack.decode.kv_usage() == 0


def test_refused_decode_leg_goes_to_another_decode(stack):
    """A D that refuses the connection (nothing listens: a killed D) is ejected and the
    same leg, with P's offer as P returned it, goes to the live D, which READs P's blocks:
    the answer equals colocated and D loaded every prompt token (no recompute)."""
    dead = closed_port_url()
    settings = RouterSettings(prefill_urls=[stack.prefill.url],
                              decode_urls=[dead, stack.decode.url], content_reuse=False,
                              health_interval_s=0, prefill_timeout_s=120, decode_timeout_s=120)
    app = create_app(settings, stack.secret.encode())
    toks = prompt(300, 31)
    want = complete(stack.prefill.url, stack.model, toks)
    before = stack.decode.transferred_tokens()
    with serve(app) as url:
        ROUTERS.add(url)  # `complete` checks the answer names no engine field
        got = complete(url, stack.model, toks)  # ties start at the first D: the dead one
        reg = app.state.metrics.registry
        assert reg.get_sample_value("kvferry_router_retries_total",
                                    {"leg": "decode", "mode": "pull"}) == 1
        assert reg.get_sample_value("kvferry_router_ejections_total",
                                    {"role": "decode",
                                     "upstream": app.state.pools["decode"].name_of(dead)}) == 1
    assert_same_output(got, want)
    assert stack.decode.transferred_tokens() - before == len(toks)
    wait_until(lambda: stack.prefill.kv_usage() == 0, 30, "P to free its blocks after D's READ")
    assert stack.decode.kv_usage() == 0


def test_prefill_killed_before_read(stack):
    """Last in this module: it kills P. D must recompute, quickly, and free its blocks."""
    toks = prompt(900, 9)
    want = complete(stack.prefill.url, stack.model, toks)
    offer = offer_for(stack, toks)
    stack.prefill.child.signal_group(signal.SIGKILL)
    stack.prefill.child.proc.wait(timeout=30)
    t0 = time.monotonic()
    got = complete(stack.decode.url, stack.model, toks, kv_transfer_params=offer, timeout=60)
    assert_same_output(got, want)
    assert time.monotonic() - t0 < EXTRA["recv_timeout_s"] + 10
    assert stack.decode.kv_usage() == 0
