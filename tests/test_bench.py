"""`kvferry bench` over real HTTP against fake engines (no vLLM): arrivals, TTFT/TPOT/handoff,
JSONL schema, plot, multi-turn growth, unsustainable-rate detection, timeouts."""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from helpers_http import FakeEngine, closed_port_url, serve
from typer.testing import CliRunner

from kvferry.router.api.app import create_app
from kvferry.router.settings import RouterSettings
from kvferry.scripts import cli
from kvferry.scripts.bench import BenchConfig, point_lines, run_bench, run_point
from kvferry.scripts.bench_core import (
    HDR_PREFILL_MS,
    MIN_TOKEN_ID,
    Result,
    StreamState,
    Target,
    arrival_offsets,
    parse_target,
)
from kvferry.scripts.bench_stats import assess_sustainable, latency_fields, percentile

SCHEMA_FIELDS = ("experiment", "impl", "mode", "hardware", "model", "input_len", "output_len", "qps",
                 "sustainable", "n", "ttft_ms_p50", "ttft_ms_p90", "tpot_ms_p50", "errors",
                 "command", "commit", "date")


@dataclass
class TimedFake:
    """Completions server with known timing.

    prefill_s: before the response headers, under a semaphore of `concurrency` (a serial P
    when 1); reported as x-kvferry-prefill-ms. handoff_s: after the headers, before the
    first token. tpot_s: between tokens. Streams max_tokens tokens with token_ids, vLLM's
    continuous usage and a final usage chunk.
    """

    prefill_s: float = 0.0
    handoff_s: float = 0.0
    tpot_s: float = 0.0
    concurrency: int | None = None
    report_prefill: bool = True
    received: list[dict[str, Any]] = field(default_factory=list)
    arrived: list[float] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()
        fake = self
        sem: list[asyncio.Semaphore] = []

        @app.get("/health")
        async def health() -> Any:
            return {}

        @app.get("/v1/models")
        async def models() -> Any:
            return {"data": [{"id": "fake-model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            fake.arrived.append(time.perf_counter())
            body = await request.json()
            fake.received.append(body)
            if not sem:
                sem.append(asyncio.Semaphore(fake.concurrency or 10**6))
            t = time.perf_counter()
            async with sem[0]:
                await asyncio.sleep(fake.prefill_s)
            headers = {"x-kvferry-prefill": "fake-p"}
            if fake.report_prefill:
                headers[HDR_PREFILL_MS] = f"{(time.perf_counter() - t) * 1e3:.3f}"
            return StreamingResponse(fake.sse(body), media_type="text/event-stream", headers=headers)

        return app

    async def sse(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        n, p = body["max_tokens"], len(body["prompt"])
        base = 1000 + len(self.received) * 10
        await asyncio.sleep(self.handoff_s)
        for i in range(n):
            if i:
                await asyncio.sleep(self.tpot_s)
            ch = {"choices": [{"index": 0, "text": "", "token_ids": [base + i]}],
                  "usage": {"prompt_tokens": p, "completion_tokens": i + 1}}
            yield f"data: {json.dumps(ch)}\n\n".encode()
        yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': n}})}\n\n".encode()
        yield b"data: [DONE]\n\n"


@pytest.fixture
def fake() -> Iterator[tuple[TimedFake, str]]:
    f = TimedFake()
    with serve(f.app()) as url:
        yield f, url


def cfg_for(tmp_path: Path, urls: dict[str, str], **kw: Any) -> BenchConfig:
    base: dict[str, Any] = dict(
        targets=[Target(name=n, url=u) for n, u in urls.items()], input_lens=[32], qps_list=[0],
        output_len=4, num_requests=4, warmup=0, progress=False, results_dir=tmp_path,
        request_timeout_s=10, command="test", commit="abc")
    base.update(kw)
    return BenchConfig(**base)


def point(cfg: BenchConfig, qps: float, input_len: int | None = None) -> Any:
    async def go() -> Any:
        async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
            return await run_point(client, cfg, cfg.targets[0], None, input_len or cfg.input_lens[0],
                                   qps)
    return asyncio.run(go())


# --- pure parts --------------------------------------------------------------------------

def test_fixed_arrivals_are_evenly_spaced() -> None:
    assert arrival_offsets(4, "fixed", "s", 5, None) == [0, 0.25, 0.5, 0.75, 1.0]
    assert arrival_offsets(4, "fixed", "s", None, 1.0) == [0, 0.25, 0.5, 0.75]
    assert len(arrival_offsets(4, "fixed", "s", 2, 10.0)) == 2


def test_poisson_arrivals_seeded_rate() -> None:
    a = arrival_offsets(5.0, "poisson", "seed-1", 4000, None)
    gaps = [y - x for x, y in zip(a, a[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.05)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.1)  # exponential
    assert a == arrival_offsets(5.0, "poisson", "seed-1", 4000, None)
    assert a != arrival_offsets(5.0, "poisson", "seed-2", 4000, None)
    b = arrival_offsets(5.0, "poisson", "seed-1", None, 100.0)
    assert max(b) < 100 and len(b) / 100 == pytest.approx(5, rel=0.15)


def test_parse_target_and_percentile() -> None:
    t = parse_target("push=http://h:1/,impl=kvferry,mode=push,x-kvferry-mode=push", "x", "pull")
    assert (t.name, t.url, t.impl, t.mode, t.headers) == (
        "push", "http://h:1", "kvferry", "push", (("x-kvferry-mode", "push"),))
    t = parse_target("http://h:2", "vllm-0.26.0", "pull")
    assert (t.name, t.url, t.impl) == ("vllm-0.26.0-pull", "http://h:2", "vllm-0.26.0")
    with pytest.raises(ValueError):
        parse_target("a=h:1", "x", "y")
    with pytest.raises(ValueError):
        parse_target("a=http://h:1,bogus=1", "x", "y")
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([], 50) is None
    assert percentile([10, 20], 90) == pytest.approx(19)


def test_sustainable_rule_on_synthetic_runs() -> None:
    arr = [i * 0.1 for i in range(20)]  # offered 10/s
    ok = assess_sustainable(arr, [a + 0.3 for a in arr], 10)
    assert ok["sustainable"] and ok["backlog_growth"] == pytest.approx(0, abs=0.5)
    slow = assess_sustainable(arr, [0.3 * (i + 1) for i in range(20)], 10)  # serves 3.3/s
    assert not slow["sustainable"] and slow["achieved_qps"] == pytest.approx(3.33, rel=0.01)
    cut = assess_sustainable(arr, [a + 0.3 for a in arr[:-1]] + [None], 10)
    assert not cut["sustainable"] and "unfinished" in cut["unsustainable_reason"]
    assert assess_sustainable([0, 1], [5, 9], 0)["sustainable"]  # serial: by construction


def test_stream_parser_tokens_usage_prefill_field_and_errors() -> None:
    r = Result(target="t", index=0, prompt_len=4)
    st = StreamState(r)
    st.feed(": comment", 1.0)
    st.feed('data: {"kvferry_prefill_ms": 12.5, "choices": []}', 1.0)
    st.feed('data: {"choices": [{"text": ""}], "usage": {"completion_tokens": 1}}', 2.0)  # empty text
    st.feed('data: {"choices": [{"text": "ab"}], "usage": {"completion_tokens": 3}}', 2.5)
    st.feed('data: {"choices": [], "usage": {"completion_tokens": 3, '
            '"prompt_tokens_details": {"cached_tokens": 2}}}', 2.7)
    st.feed("data: [DONE]", 2.8)
    st.finish(2.8)
    r.sent = 0.5
    assert (r.first, r.last, r.end, r.n_tokens, st.chunks) == (2.0, 2.5, 2.8, 3, 2)
    assert st.text == "ab"
    assert r.prefill_ms == 12.5 and r.cached_tokens == 2 and r.ok
    assert r.ttft_ms == pytest.approx(1500) and r.tpot_ms == pytest.approx(250)
    assert r.handoff_ms == pytest.approx(1487.5)
    rec = r.record(0.0)  # wall-clock instants, to join the timeline marks
    assert (rec["first_unix"] - rec["sent_unix"]) * 1e3 == pytest.approx(r.ttft_ms)
    assert abs(rec["sent_unix"] - (time.time() - time.perf_counter() + 0.5)) < 1.0
    bad = Result(target="t", index=1, prompt_len=4)
    st = StreamState(bad)
    st.feed('data: {"error": {"message": "decode died"}}', 1.0)
    st.finish(1.0)
    assert bad.error is not None and "decode died" in bad.error


def test_reuse_report_from_push_event_and_point_fields() -> None:
    """Push: the router's reuse report is a choice-less SSE event; a point reports the
    mean reused tokens and the reasons over the requests that carried a report."""
    pushed = Result(target="t", index=0, prompt_len=900)
    st = StreamState(pushed)
    st.feed('data: {"choices": [{"text": "a"}]}', 1.0)
    st.feed('data: {"choices": [], "kvferry_prefill_ms": 5, "kvferry_reused_tokens": 256, '
            '"kvferry_reuse_reason": "ok"}', 1.1)
    st.feed("data: [DONE]", 1.2)
    st.finish(1.2)
    assert (pushed.reused_tokens, pushed.reuse_reason, st.chunks) == (256, "ok", 1)
    covered = Result(target="t", index=1, prompt_len=900, first=1.0, reused_tokens=0,
                     reuse_reason="local_hit_covers")
    first_turn = Result(target="t", index=2, prompt_len=500, first=1.0)
    out = latency_fields([pushed, covered, first_turn])
    assert out["reused_tokens_mean"] == 128.0
    assert out["reuse_reasons"] == {"local_hit_covers": 1, "ok": 1}
    assert "reused_tokens_mean" not in latency_fields([first_turn])
    assert pushed.record(0.0)["reused_tokens"] == 256


# --- over real HTTP ----------------------------------------------------------------------

@pytest.mark.timing
def test_ttft_tpot_handoff_against_known_delays(tmp_path: Path, fake: tuple[TimedFake, str]) -> None:
    f, url = fake
    f.prefill_s, f.handoff_s, f.tpot_s = 0.10, 0.04, 0.03
    cfg = cfg_for(tmp_path, {"t": url}, output_len=5, num_requests=3, vocab=50, input_lens=[64])
    p = point(cfg, 0)
    assert len(p.results) == 3
    for r in p.results:
        assert r.ok, r.error
        assert r.n_tokens == 5 and r.output_ids is not None and len(r.output_ids) == 5
        assert 135 <= r.ttft_ms < 230, r.ttft_ms
        assert 28 <= r.tpot_ms < 50, r.tpot_ms
        assert 28 <= r.tpot_decode_ms < 50 and 28 <= r.t2_ms - r.ttft_ms < 50, r.record(0)
        assert 95 <= r.prefill_ms < 150
        assert 38 <= r.handoff_ms < 110, r.handoff_ms
        assert r.headers["x-kvferry-prefill"] == "fake-p"
    for body in f.received:
        assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0
        assert body["max_tokens"] == 5 and len(body["prompt"]) == 64
        assert all(MIN_TOKEN_ID <= t < 50 for t in body["prompt"])
        assert "conversation_id" not in body
    assert len({tuple(b["prompt"]) for b in f.received}) == 3  # distinct prompts
    (line,) = point_lines(cfg, p)
    assert line["n"] == 3 and line["errors"] == 0 and line["sustainable"]
    assert 135 <= line["ttft_ms_p50"] <= line["ttft_ms_p90"] < 230
    assert 38 <= line["handoff_ms_p50"] < 110
    assert 28 <= line["tpot_decode_ms_p50"] < 50 and 165 <= line["t2_ms_p50"] < 280


def test_second_token_and_decode_tpot_without_the_first_gap() -> None:
    """A first token sent early (P's) lengthens the token-1 -> token-2 gap and so the
    schema's TPOT; t2 and tpot_decode do not move with it."""
    def stream(first_at: float, usage: bool) -> Result:
        r = Result(target="t", index=0, prompt_len=4, sent=0.0)
        st = StreamState(r)
        for k, at in enumerate([first_at, 1.0, 1.1, 1.2, 1.3], start=1):
            u = f', "usage": {{"completion_tokens": {k}}}' if usage else ""
            st.feed(f'data: {{"choices": [{{"text": "x", "token_ids": [{k}]}}]{u}}}', at)
        st.finish(1.3)
        return r

    late, early = stream(0.9, True), stream(0.5, False)  # D's token 1 / P's, token ids only
    for r in (late, early):
        assert r.n_tokens == 5 and r.tokens_by_second == 2
        assert r.t2_ms == pytest.approx(1000) and r.tpot_decode_ms == pytest.approx(100)
    assert late.tpot_ms == pytest.approx(100) and early.tpot_ms == pytest.approx(200)
    merged = Result(target="t", index=0, prompt_len=4, sent=0.0)  # vLLM merged tokens 2-3
    st = StreamState(merged)
    for at, ids in ((0.5, [1]), (1.0, [2, 3]), (1.1, [4]), (1.2, [5])):
        st.feed(f'data: {{"choices": [{{"text": "x", "token_ids": {ids}}}]}}', at)
    st.finish(1.2)
    assert merged.tokens_by_second == 3 and merged.tpot_decode_ms == pytest.approx(100)
    assert merged.record(0.0)["second_ms"] == pytest.approx(1000)
    line = latency_fields([late, early])
    assert line["t2_ms_p50"] == pytest.approx(1000) and line["tpot_decode_ms_p50"] == pytest.approx(100)


@pytest.mark.timing
def test_helpers_fake_engine_chunk_counting(tmp_path: Path) -> None:
    eng = FakeEngine("d", chunks=4, chunk_delay_s=0.03)  # no usage, no token ids: count chunks
    with serve(eng.app()) as url:
        p = point(cfg_for(tmp_path, {"e": url}, num_requests=2), 0)
    for r in p.results:
        assert r.ok and r.n_tokens == 4 and r.prefill_ms is None and r.handoff_ms is None
        assert 28 <= r.tpot_ms < 50
    (line,) = point_lines(cfg_for(tmp_path, {"e": url}), p)
    assert "handoff_ms_p50" not in line and line["n"] == 2


@pytest.mark.timing
def test_open_loop_sends_on_schedule(tmp_path: Path, fake: tuple[TimedFake, str]) -> None:
    f, url = fake
    f.prefill_s = 0.2  # long requests must not delay later sends (open loop)
    cfg = cfg_for(tmp_path, {"t": url}, num_requests=10, arrival="fixed")
    p = point(cfg, 20)
    gaps = [y - x for x, y in zip(f.arrived, f.arrived[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.05, abs=0.01)
    assert all(0.02 < g < 0.09 for g in gaps), gaps
    assert max(r.send_lag_ms for r in p.results) < 30
    f.arrived.clear()
    p = point(cfg_for(tmp_path, {"t": url}, num_requests=12, seed=3), 20)
    sent = sorted(r.sent - p.t0 for r in p.results)
    want = arrival_offsets(20, "poisson", "3:32:20", 12, None)
    assert sent == pytest.approx(want, abs=0.03)


def test_unsustainable_rate_is_flagged(tmp_path: Path, fake: tuple[TimedFake, str]) -> None:
    f, url = fake
    f.prefill_s, f.concurrency = 0.08, 1  # a serial P: 12.5 requests/s at most
    cfg = cfg_for(tmp_path, {"t": url}, num_requests=16, arrival="fixed")
    (fast,) = point_lines(cfg, point(cfg, 40))
    assert fast["sustainable"] is False and fast["n"] == 16
    assert fast["achieved_qps"] < 0.5 * fast["offered_qps_actual"]
    assert fast["backlog_growth"] >= 3
    f.prefill_s = 0.01
    (easy,) = point_lines(cfg, point(cfg, 20))
    assert easy["sustainable"] is True, easy


def test_timeouts_and_errors_are_counted_never_hang(tmp_path: Path,
                                                    fake: tuple[TimedFake, str]) -> None:
    f, url = fake
    f.prefill_s = 5.0
    cfg = cfg_for(tmp_path, {"t": url}, num_requests=4, request_timeout_s=0.3, arrival="fixed")
    t = time.monotonic()
    (line,) = point_lines(cfg, point(cfg, 20))
    assert time.monotonic() - t < 2.5
    assert line["n"] == 0 and line["errors"] == 4 and line["timeouts"] == 4
    assert line["sustainable"] is False and "ttft_ms_p50" not in line
    eng = FakeEngine("bad", status=500)
    with serve(eng.app()) as bad:
        (line,) = point_lines(cfg, point(cfg_for(tmp_path, {"b": bad}, num_requests=3), 0))
    assert line["errors"] == 3 and line["timeouts"] == 0 and "HTTP 500" in line["error_samples"][0]


def test_multi_turn_prompts_grow_with_outputs(tmp_path: Path, fake: tuple[TimedFake, str]) -> None:
    f, url = fake
    cfg = cfg_for(tmp_path, {"t": url}, turns=3, turn_growth=7, output_len=5, num_requests=3,
                  input_lens=[20], arrival="fixed")
    p = point(cfg, 30)
    by_conv: dict[str, list[dict[str, Any]]] = {}
    for b in f.received:
        by_conv.setdefault(b["conversation_id"], []).append(b)
        assert b["return_token_ids"] is True
    assert len(by_conv) == 3
    outs = {(r.conversation, r.turn): r.output_ids for r in p.results}
    for bodies in by_conv.values():
        assert [len(b["prompt"]) for b in bodies] == [20, 32, 44]
        for k in (1, 2):
            prev, nxt = bodies[k - 1]["prompt"], bodies[k]["prompt"]
            assert nxt[:len(prev)] == prev
            grown = nxt[len(prev):len(prev) + 5]
            assert grown in [o for (_, t), o in outs.items() if t == k]  # the real output ids
    lines = point_lines(cfg, p)
    assert [(ln["turn"], ln["input_len"]) for ln in lines] == [(1, 20), (2, 32), (3, 44)]
    assert all(ln["history_exact"] and ln["n"] == 3 and ln["first_input_len"] == 20 for ln in lines)


def test_through_router_reads_headers_and_strips_conversation_id(tmp_path: Path) -> None:
    p_eng = FakeEngine("p", kv_params={"remote_engine_id": "p", "remote_block_ids": [1]})
    d_eng = FakeEngine("d", chunks=3)
    with serve(p_eng.app()) as purl, serve(d_eng.app()) as durl, \
            serve(create_app(RouterSettings(prefill_urls=[purl], decode_urls=[durl]))) as rurl:
        cfg = cfg_for(tmp_path, {"r": rurl}, turns=2, turn_growth=3, num_requests=2, output_len=3)
        p = point(cfg, 0)
    assert all(r.ok for r in p.results) and len(p.results) == 4
    assert all(r.headers["x-kvferry-prefill"] == purl and r.headers["x-kvferry-decode"] == durl
               for r in p.results)
    assert all("conversation_id" not in b for b in p_eng.received + d_eng.received)
    assert [len(b["prompt"]) for b in d_eng.received] == [32, 38, 32, 38]  # 32 + 3 out + 3 new
    assert all(ln["history_exact"] is False for ln in point_lines(cfg, p))  # no token ids


def test_cli_writes_schema_lines_and_plot(tmp_path: Path, fake: tuple[TimedFake, str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    f, url = fake
    f.prefill_s, f.tpot_s = 0.01, 0.002
    eng = FakeEngine("colo", chunks=4)
    with serve(eng.app()) as colo:
        argv = ["kvferry", "bench", "--target", f"push={url},impl=kvferry,mode=push",
                "--target", f"colocated={colo},impl=colocated,mode=colocated",
                "--input-len", "16,32", "--qps", "0,25", "--num-requests", "4", "--output-len", "4",
                "--experiment", "push_vs_pull", "--hardware", "cpu", "--model-name", "tiny",
                "--results-dir", str(tmp_path / "res"), "--plot", str(tmp_path / "p.png"),
                "--raw", str(tmp_path / "raw.jsonl"), "--no-progress", "--vocab", "100"]
        monkeypatch.setattr(sys, "argv", argv)
        out = CliRunner().invoke(cli.app, argv[1:])
    assert out.exit_code == 0, out.output
    (path,) = (tmp_path / "res").glob("push_vs_pull-cpu-*.jsonl")
    assert len(path.name) == len("push_vs_pull-cpu-20260101.jsonl")
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 2 * 2 * 2
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()
    for ln in lines:
        missing = [k for k in SCHEMA_FIELDS if k not in ln]
        assert not missing, missing
        assert ln["command"] == " ".join(argv) and ln["commit"] == head and ln["n"] == 4
        assert ln["model"] == "tiny" and ln["hardware"] == "cpu"
    by = {(ln["impl"], ln["mode"]) for ln in lines}
    assert by == {("kvferry", "push"), ("colocated", "colocated")}
    assert all("handoff_ms_p50" in ln for ln in lines if ln["impl"] == "kvferry")
    assert all("handoff_ms_p50" not in ln for ln in lines if ln["impl"] == "colocated")
    assert f.received[0]["model"] == "fake-model"
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((tmp_path / "raw.jsonl").read_text().splitlines()) == 2 * 2 * 2 * 4


def test_unhealthy_target_fails_fast(tmp_path: Path) -> None:
    cfg = cfg_for(tmp_path, {"dead": closed_port_url()})
    with pytest.raises(RuntimeError, match="not healthy"):
        asyncio.run(run_bench(cfg))
    out = CliRunner().invoke(cli.app, ["bench", "--target", closed_port_url(), "--no-progress",
                                       "--results-dir", str(tmp_path)])
    assert out.exit_code == 2
