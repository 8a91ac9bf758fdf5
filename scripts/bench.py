"""`kvferry bench`: open-loop load against one or more RUNNING stacks, side by side.

For every input length, every offered rate and every target (targets back to back per
point, same arrival schedule), requests with random token-id prompts are streamed to
`<target>/v1/completions`; per request TTFT, TPOT, the router's `x-kvferry-*` headers and
(when the router reports the P leg's duration) the handoff are measured. One JSON line per
(target, input_len, qps[, turn]) is appended to
`benchmarks/results/<experiment>-<hardware>-<YYYYMMDD>.jsonl` (format:
shared/bench-schema.md). Engines are never started here.

Prompts are distinct per target unless --same-prompts: two targets that share engines
(e.g. one router, `x-kvferry-mode=push|pull` per target) would otherwise hit P's prefix
cache on the second target. Random ids make compute cost independent of content.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from .bench_core import (
    Result,
    Target,
    arrival_offsets,
    make_prompt,
    random_tokens,
    request_body,
    send_request,
)
from .bench_stats import assess_sustainable, latency_fields

DEFAULT_NUM_REQUESTS = 32
CANCEL_GRACE_S = 5.0


@dataclass
class BenchConfig:
    """One `kvferry bench` run."""

    targets: list[Target]
    input_lens: list[int]
    qps_list: list[float]
    output_len: int = 128
    arrival: str = "poisson"
    seed: int = 0
    num_requests: int | None = None
    duration_s: float | None = None
    vocab: int = 1000
    prefix_len: int = 0
    turns: int = 1
    turn_growth: int = 256
    think_time_s: float = 0.0
    request_timeout_s: float = 300.0
    same_prompts: bool = False
    warmup: int = 1
    served_model: str | None = None
    experiment: str = "push_vs_pull"
    hardware: str = "cpu"
    model_name: str = "tiny"
    results_dir: Path = Path("benchmarks/results")
    raw_path: Path | None = None
    plot_path: Path | None = None
    progress: bool = True
    command: str = ""
    commit: str | None = None
    commit_dirty: bool | None = None
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    started: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))

    @property
    def count(self) -> int | None:
        if self.num_requests is None and self.duration_s is None:
            return DEFAULT_NUM_REQUESTS
        return self.num_requests

    @property
    def out_path(self) -> Path:
        day = self.started.strftime("%Y%m%d")
        return self.results_dir / f"{self.experiment}-{self.hardware}-{day}.jsonl"

    def planned(self, qps: float) -> int | None:
        """Conversations (requests when turns == 1) per point; None if only time-bounded."""
        if qps > 0:
            return len(arrival_offsets(qps, self.arrival, "plan", self.count, self.duration_s))
        return self.count


@dataclass
class PointRun:
    """Raw outcome of one (target, input_len, qps) point."""

    target: Target
    input_len: int
    qps: float
    t0: float
    results: list[Result]
    history_exact: bool = True


def git_commit(start: Path | None = None) -> tuple[str | None, bool | None]:
    """KVFERRY_COMMIT when set (where the tree travels to another machine, e.g. the GPU
    one, whose copy may carry a stale .git: two runs there recorded the HEAD of an earlier
    call); else (HEAD, dirty) of the repo holding this package (or the cwd); (None, None)
    if unknown."""
    env = os.environ.get("KVFERRY_COMMIT")
    if env:
        return env, None
    for where in (start or Path(__file__).resolve().parents[1], Path.cwd()):
        try:
            head = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], check=True,
                                  capture_output=True, text=True, timeout=10).stdout.strip()
            st = subprocess.run(["git", "-C", str(where), "status", "--porcelain",
                                 "--untracked-files=no"], capture_output=True, text=True,
                                timeout=10).stdout
            return head, bool(st.strip())
        except (OSError, subprocess.SubprocessError):
            continue
    return None, None


async def resolve_model(client: httpx.AsyncClient, target: Target, served: str | None) -> str | None:
    """Model name for the body: the target's, --served-model, else the first of /v1/models."""
    if target.model or served:
        return target.model or served
    try:
        resp = await client.get(target.url + "/v1/models", timeout=10)
        data = resp.json().get("data") or []
        return str(data[0]["id"]) if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None


async def check_health(client: httpx.AsyncClient, target: Target) -> str | None:
    """None when GET /health answers 200, else a message."""
    try:
        resp = await client.get(target.url + "/health", timeout=10)
    except httpx.HTTPError as exc:
        return f"{target.name} ({target.url}): {type(exc).__name__}: {exc}"
    return None if resp.status_code == 200 else f"{target.name}: /health HTTP {resp.status_code}"


async def run_point(client: httpx.AsyncClient, cfg: BenchConfig, target: Target, model: str | None,
                    input_len: int, qps: float,
                    on_result: Callable[[Result], None] = lambda r: None) -> PointRun:
    """Drive one point: open-loop arrivals (qps > 0) or one conversation at a time (qps 0).

    Each arrival starts a conversation of cfg.turns turns (1: a plain request); turn k+1 is
    sent when turn k finished (+ think time), its prompt = turn k's prompt + turn k's
    output ids + turn_growth new ids. Bounded by count/duration and per-request timeouts;
    whatever is still running CANCEL_GRACE_S after its last possible deadline is cancelled
    and counted as a timeout.
    """
    salt = "" if cfg.same_prompts else target.salt
    pseed = f"{cfg.seed}:{salt}:{input_len}:{qps:g}"
    prefix = None
    if cfg.prefix_len:
        prefix = random_tokens(f"{cfg.seed}:{salt}:prefix:{input_len}",
                               min(cfg.prefix_len, input_len), cfg.vocab)
    multi = cfg.turns > 1
    results: list[Result] = []
    point = PointRun(target, input_len, qps, time.perf_counter(), results)

    def first_prompt(i: int) -> list[int]:
        return make_prompt(f"{pseed}:{i}", input_len, cfg.vocab, prefix)

    async def conversation(i: int, scheduled: float, prompt: list[int]) -> None:
        cid = f"bench-{cfg.run_id}-{target.name}-{input_len}-{qps:g}-{i}" if multi else None
        for turn in range(1, cfg.turns + 1):
            res = Result(target=target.name, index=i, prompt_len=len(prompt),
                         turn=turn if multi else None, conversation=i if multi else None,
                         scheduled=scheduled)
            results.append(res)
            body = request_body(prompt, cfg.output_len, model, cid, token_ids=multi)
            await send_request(client, target, body, res, cfg.request_timeout_s)
            on_result(res)
            if not res.ok or turn == cfg.turns:
                return
            out = res.output_ids
            if out is None or len(out) != res.n_tokens:
                point.history_exact = False  # the target did not return token ids
                out = random_tokens(f"{pseed}:{i}:out{turn}", res.n_tokens, cfg.vocab)
            prompt = prompt + out + random_tokens(f"{pseed}:{i}:t{turn + 1}", cfg.turn_growth,
                                                  cfg.vocab)
            if cfg.think_time_s > 0:
                await asyncio.sleep(cfg.think_time_s)
            scheduled = time.perf_counter()

    per_conv_s = cfg.turns * (cfg.request_timeout_s + cfg.think_time_s) + CANCEL_GRACE_S
    if qps > 0:
        offsets = arrival_offsets(qps, cfg.arrival, f"{cfg.seed}:{input_len}:{qps:g}",
                                  cfg.count, cfg.duration_s)
        t0 = point.t0 = time.perf_counter() + 0.05
        tasks = []
        for i, off in enumerate(offsets):
            prompt = first_prompt(i)  # built before its send time: not in the TTFT
            delay = t0 + off - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(conversation(i, t0 + off, prompt)))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=per_conv_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    else:
        t0 = point.t0 = time.perf_counter()
        i = 0
        while (cfg.count is None or i < cfg.count) and (
                cfg.duration_s is None or time.perf_counter() - t0 < cfg.duration_s):
            prompt = first_prompt(i)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(conversation(i, time.perf_counter(), prompt), per_conv_s)
            i += 1
    for r in results:
        if r.end is None and r.error is None:
            r.timed_out, r.error = True, "cancelled at the end of the point"
    return point


def point_lines(cfg: BenchConfig, p: PointRun) -> list[dict[str, Any]]:
    """Schema lines for one point: one, or one per turn in multi-turn mode."""
    # Sustainability is judged per job: a request, or a whole conversation.
    convs: dict[int, list[Result]] = {}
    for r in p.results:
        convs.setdefault(r.index, []).append(r)
    arrivals, ends, failed = [], [], 0
    for i in sorted(convs):
        rs = convs[i]
        arrivals.append(rs[0].sent - p.t0)
        last = rs[-1]
        timed_out = any(r.timed_out for r in rs)
        ends.append(None if timed_out or last.end is None else last.end - p.t0)
        failed += any(r.error and not r.timed_out for r in rs)
    sustain = assess_sustainable(arrivals, ends, p.qps, failed)
    date = cfg.started
    base: dict[str, Any] = {
        "experiment": cfg.experiment, "impl": p.target.impl, "mode": p.target.mode,
        "hardware": cfg.hardware, "model": cfg.model_name, "target": p.target.name,
        "url": p.target.url, "input_len": p.input_len, "output_len": cfg.output_len,
        "qps": p.qps, "arrival": cfg.arrival if p.qps > 0 else "serial",
    }
    if cfg.prefix_len:
        base["prefix_len"] = min(cfg.prefix_len, p.input_len)
    tail = {"seed": cfg.seed, "run_id": cfg.run_id, "command": cfg.command, "commit": cfg.commit,
            "commit_dirty": cfg.commit_dirty, "date": date.date().isoformat(),
            "time": date.isoformat(timespec="seconds")}
    if cfg.turns == 1:
        return [{**base, **sustain, **latency_fields(p.results), **tail}]
    lines = []
    for turn in range(1, cfg.turns + 1):
        rs = [r for r in p.results if r.turn == turn]
        if not rs:
            continue
        line = {**base, "input_len": int(statistics.median(r.prompt_len for r in rs)),
                "first_input_len": p.input_len, "turn": turn, "turns": cfg.turns,
                "turn_growth": cfg.turn_growth, "conversations": len(convs),
                "history_exact": p.history_exact, **sustain, **latency_fields(rs), **tail}
        lines.append(line)
    return lines


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)


def summary(line: dict[str, Any]) -> str:
    turn = f" turn={line['turn']}" if "turn" in line else ""
    s = (f"{line['target']:>18} in={line['input_len']}{turn} qps={line['qps']:g}: "
         f"n={line['n']} err={line['errors']} ttft p50/p90={_fmt(line.get('ttft_ms_p50'))}/"
         f"{_fmt(line.get('ttft_ms_p90'))} ms tpot p50={_fmt(line.get('tpot_ms_p50'))} ms "
         f"handoff p50={_fmt(line.get('handoff_ms_p50'))} ms")
    if "reused_tokens_mean" in line:
        s += f" reused={_fmt(line['reused_tokens_mean'])} {line.get('reuse_reasons', {})}"
    if not line["sustainable"]:
        s += f"  UNSUSTAINABLE ({line.get('unsustainable_reason', '')})"
    return s


async def run_bench(cfg: BenchConfig, echo: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Run every point, append lines as they are measured; returns all lines."""
    from tqdm import tqdm

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
    total = 0
    for q in cfg.qps_list:
        n = cfg.planned(q)
        total = None if n is None or total is None else total + n * cfg.turns * len(cfg.targets) * len(
            cfg.input_lens)
    lines: list[dict[str, Any]] = []
    cfg.out_path.parent.mkdir(parents=True, exist_ok=True)
    if cfg.raw_path:
        cfg.raw_path.parent.mkdir(parents=True, exist_ok=True)
    async with httpx.AsyncClient(trust_env=False, limits=limits, timeout=timeout) as client:
        bad = [m for m in await asyncio.gather(*(check_health(client, t) for t in cfg.targets)) if m]
        if bad:
            raise RuntimeError("target(s) not healthy: " + "; ".join(bad))
        models = {t.name: await resolve_model(client, t, cfg.served_model) for t in cfg.targets}
        with tqdm(total=total, unit="req", file=sys.stderr, disable=not cfg.progress,
                  dynamic_ncols=True) as bar:
            say = echo or bar.write
            errors = 0

            def tick(r: Result) -> None:
                nonlocal errors
                errors += not r.ok
                bar.update(1)
                bar.set_postfix(errors=errors, refresh=False)

            for t in cfg.targets:
                for w in range(cfg.warmup):
                    res = Result(target=t.name, index=-1, prompt_len=min(cfg.input_lens))
                    body = request_body(make_prompt(f"warmup:{cfg.run_id}:{t.name}:{w}",
                                                    min(cfg.input_lens), cfg.vocab),
                                        min(cfg.output_len, 4), models[t.name])
                    await send_request(client, t, body, res, cfg.request_timeout_s)
                    if not res.ok:
                        say(f"warmup of {t.name} failed: {res.error}")
            for input_len in cfg.input_lens:
                for qps in cfg.qps_list:
                    for t in cfg.targets:
                        bar.set_description(f"{t.name} in={input_len} qps={qps:g}")
                        point = await run_point(client, cfg, t, models[t.name], input_len, qps, tick)
                        new = point_lines(cfg, point)
                        with cfg.out_path.open("a") as f:
                            for line in new:
                                f.write(json.dumps(line) + "\n")
                        if cfg.raw_path:
                            with cfg.raw_path.open("a") as f:
                                for r in point.results:
                                    rec = {"run_id": cfg.run_id, "input_len": input_len, "qps": qps,
                                           **r.record(point.t0)}
                                    f.write(json.dumps(rec) + "\n")
                        for line in new:
                            say(summary(line))
                        lines += new
    if cfg.plot_path:
        from .bench_plot import plot_lines

        plot_lines(lines, cfg.plot_path)
    return lines
