"""Pure parts of the router: body transforms, leg building, least-loaded choice."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvferry.router.api.app import resolve_mode
from kvferry.router.fleet.upstreams import UpstreamPool
from kvferry.router.legs.flow import build_legs
from kvferry.router.settings import RouterSettings
from kvferry.router.wire import bodies
from kvferry.router.wire.sse_filters import InsertBeforeDone


def test_sanitize_drops_router_fields_and_copies_the_top_level() -> None:
    body = {"prompt": "x", "kv_transfer_params": {"a": 1}, "kvferry_mode": "pull",
            "conversation_id": "c", "extra": {"n": [1]}}
    clean = bodies.sanitize(body)
    assert clean == {"prompt": "x", "extra": {"n": [1]}}
    clean["prompt"] = "y"
    d = bodies.decode_body(clean, {"k": 1})
    d["kv_transfer_params"]["k"] = 2
    assert body["prompt"] == "x" and "kv_transfer_params" not in clean
    # Nested values are shared on purpose (long prompts are never deep-copied).
    assert d["extra"] is body["extra"]


def test_encode_decode_json() -> None:
    body = {"prompt": list(range(5)), "max_tokens": 3, "stream": True, "t": 0.5, "s": "é"}
    assert bodies.decode(bodies.encode(body)) == body
    for bad in (b"{", b"", b"\xff", b"{'a': 1}"):
        with pytest.raises(ValueError):
            bodies.decode(bad)


def test_prefill_body_completions_vs_chat() -> None:
    clean = {"prompt": "x", "max_tokens": 9, "stream": True, "stream_options": {}, "min_tokens": 3}
    p = bodies.prefill_body(clean, bodies.COMPLETIONS, {"k": 1})
    assert p == {"prompt": "x", "max_tokens": 1, "stream": False, "kv_transfer_params": {"k": 1}}
    c = bodies.prefill_body({"messages": []}, bodies.CHAT, {})
    assert c["max_tokens"] == 1 and c["max_completion_tokens"] == 1
    assert clean["max_tokens"] == 9  # input untouched


def test_decode_body_and_extract() -> None:
    assert bodies.decode_body({"a": 1}, None) == {"a": 1}
    assert bodies.decode_body({"a": 1}, {"b": 2}) == {"a": 1, "kv_transfer_params": {"b": 2}}
    assert bodies.extract_kv_params({"kv_transfer_params": {"x": 1}}) == {"x": 1}
    for bad in (None, [], {}, {"kv_transfer_params": None}, {"kv_transfer_params": {}},
                {"kv_transfer_params": "s"}):
        assert bodies.extract_kv_params(bad) is None


def test_build_legs() -> None:
    pull = build_legs("pull", bodies.COMPLETIONS, {"prompt": "x"}, "t1")
    assert pull.decode_body is None
    assert pull.prefill_body["kv_transfer_params"] == {"do_remote_decode": True,
                                                       "transfer_id": "t1"}
    push = build_legs("push", bodies.CHAT, {"messages": [], "stream": True}, "t2",
                      ("10.0.0.1", 5600))
    assert push.decode_body is not None
    assert push.decode_body["kv_transfer_params"] == {
        "do_remote_prefill": True, "push": True, "transfer_id": "t2",
        "remote_host": "10.0.0.1", "remote_port": 5600}
    assert push.decode_body["stream"] is True
    assert push.prefill_body["kv_transfer_params"] == {
        "do_remote_decode": True, "push": True, "transfer_id": "t2"}
    assert push.prefill_body["stream"] is False
    with pytest.raises(ValueError):
        build_legs("push", bodies.CHAT, {"messages": []}, "t3")


def test_least_loaded_round_robin_ties() -> None:
    pool = UpstreamPool("p", ["a", "b", "c"])
    assert [pool.choose().url for _ in range(4)] == ["a", "b", "c", "a"]
    b = pool.upstreams[1]
    pool.acquire(pool.upstreams[0])
    pool.acquire(b)
    assert pool.choose().url == "c"
    with pool.lease() as up:
        assert up.url == "c" and up.in_flight == 1
    assert pool.upstreams[2].in_flight == 0
    pool.release(b)
    pool.release(b)
    assert b.in_flight == 0


def test_settings_and_mode() -> None:
    s = RouterSettings(prefill_urls=["http://a:1/, http://b:2"], decode_urls=["http://c:3"])
    assert s.prefill_urls == ["http://a:1", "http://b:2"]
    with pytest.raises(ValidationError):
        RouterSettings(prefill_urls=["a:1"], decode_urls=["http://c:3"])
    with pytest.raises(ValidationError):
        RouterSettings(prefill_urls=[], decode_urls=["http://c:3"])
    assert resolve_mode(s, None, {}) == "pull"
    assert resolve_mode(s, "push", {"kvferry_mode": "pull"}) == "push"  # header wins
    assert resolve_mode(s, None, {"kvferry_mode": "push"}) == "push"
    with pytest.raises(ValueError, match="unknown mode"):
        resolve_mode(s, "teleport", {})


def test_settings_prefill_kv_addrs() -> None:
    urls = ["http://a:1", "http://b:2"]
    s = RouterSettings(prefill_urls=urls, decode_urls=["http://c:3"],
                       prefill_kv_addrs=["10.0.0.1:5600, [::1]:5601"], mode="push")
    assert s.prefill_kv_addrs == ["10.0.0.1:5600", "[::1]:5601"]
    assert s.prefill_kv_addr("http://b:2") == ("::1", 5601)
    assert s.prefill_kv_addr("http://x:9") is None
    assert RouterSettings(prefill_urls=urls, decode_urls=["http://c:3"]).prefill_kv_addr(
        "http://a:1") is None
    for bad in (["h:1"], ["h:1", "h:2", "h:3"], ["h", "h:2"], ["h:1", "h:99999"], ["h:1", ":2"]):
        with pytest.raises(ValidationError):
            RouterSettings(prefill_urls=urls, decode_urls=["http://c:3"], prefill_kv_addrs=bad)
    with pytest.raises(ValidationError, match="push"):
        RouterSettings(prefill_urls=urls, decode_urls=["http://c:3"], mode="push")


def test_insert_before_done_across_chunk_boundaries() -> None:
    stream = b'data: {"a": 1}\n\ndata: [DONE]\n\n'
    for cut in range(1, len(stream)):
        f = InsertBeforeDone(lambda: b"data: {}\n\n")
        out = f.feed(stream[:cut]) + f.feed(stream[cut:]) + f.flush()
        assert out == b'data: {"a": 1}\n\ndata: {}\n\ndata: [DONE]\n\n', cut
    f = InsertBeforeDone(lambda: None)  # nothing to add: bytes unchanged
    assert f.feed(stream) + f.flush() == stream
    f = InsertBeforeDone(lambda: b"X")  # no [DONE] at all (broken stream): nothing lost
    assert f.feed(b"data: x\n\nda") + f.flush() == b"data: x\n\nda"


def test_router_without_the_secret_says_reuse_is_off(caplog: pytest.LogCaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """D refuses lease requests not signed with the deployment secret (`kvferry up` once
    started its router without it): a router that would ask D for leases says so."""
    from kvferry.router.api.app import create_app

    monkeypatch.delenv("KVFERRY_SECRET", raising=False)
    s = RouterSettings(prefill_urls=["http://p"], decode_urls=["http://d"],
                       decode_control_addrs=["127.0.0.1:5666"])
    with caplog.at_level("WARNING", logger="kvferry.router.api.app"):
        create_app(s)
    assert "KVFERRY_SECRET is not set" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvferry.router.api.app"):
        create_app(s, b"k")
        create_app(RouterSettings(prefill_urls=["http://p"], decode_urls=["http://d"]))
    assert "KVFERRY_SECRET" not in caplog.text  # a key, or no leases to ask for


def test_reuse_report_header_wins_and_bad_values_are_no_report() -> None:
    from kvferry.router.wire.headers import reuse_report

    fields = {"kvferry_reused_tokens": 64, "kvferry_reuse_reason": "ok"}
    hdrs = {"x-kvferry-reused-tokens": "128", "x-kvferry-reuse-reason": "ok"}
    assert reuse_report(hdrs, fields) == (128, "ok")
    assert reuse_report({}, fields) == (64, "ok")
    assert reuse_report({}, {}) is None
    assert reuse_report({"x-kvferry-reused-tokens": "many"}, fields) is None
    assert reuse_report({}, {"kvferry_reused_tokens": True}) is None
