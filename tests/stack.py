"""Real engine stacks for end-to-end tests: vLLM CPU engines + the router, on loopback.

Engines are started with the same argv/env builders `kvferry up` uses, so the tests run
the deployed command lines, and are pinned one core each (unpinned engines on 2 cores
make TTFT jump from ~0.2 s to 20-60 s).
"""

from __future__ import annotations

import os
import random
import re
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import httpx
from helpers_http import free_port, serve

from kvferry.connectors.config import ConnectorConfig
from kvferry.connectors.transfer.handshake import HandshakeError, fetch_engine_stats
from kvferry.connectors.transfer.stats import Snapshot
from kvferry.router.api.app import create_app
from kvferry.router.settings import RouterSettings
from kvferry.router.wire.bodies import ENGINE_FIELDS
from kvferry.scripts.cpu_pin import restore_worker_binding
from kvferry.scripts.engines import EngineSpec, engine_argv, engine_env, vllm_engine_id
from kvferry.scripts.procs import Child, stop_all, wait_healthy

STARTUP_S = float(os.environ.get("KVFERRY_TEST_STARTUP_S", "900"))

# CORE_RULE: engines that move KV between them never share a core; on two cores the Ps
# share one and the Ds the other. Measured (tests/test_e2e_tp.py's stack, P TP 2 + D TP 1,
# 2 cores): with P's rank 1 and D both on core 1, a fresh pair's first pull took 0.3-42 s
# (over 2 s in 14 of 18 start-ups; CI saw it pass the 60 s READ timeout), always while D
# met P's rank 1 (the hello and NIXL's add_remote_agent took ms; D's transfer thread then
# did not run again for 2-12 s), and a steady pull took 1.2 s; with P's ranks both on
# core 0 and D alone on core 1, 31-35 ms and 0.2-0.4 s in 4 of 4. What holds that thread
# back on the shared core is not known yet (issue #18): both engines' idle workers spin
# on sched_yield there (vLLM's shm_broadcast busy_loop_s=1), and perf caught D's NIXL
# progress thread in pthread_spin_lock; UCX_USE_MT_MUTEX=y did not help (2 of 5 slow).
# Time an engine may take to act on a deadline it passed or an event that already
# happened (its next poll, a step on shared cores) plus our stats request: the slack
# added to a configured timeout when a test waits for what that timeout bounds.
ACT_S = 5.0

T = TypeVar("T")

# Every engine the tests started and still running: a failing test's report carries the
# tails of their logs (conftest.py), since CI keeps nothing but pytest's output.
STARTED: list[Child] = []
ENGINES: list[Engine] = []  # the kvferry ones: the report carries their counters too

# Routers the tests started: every answer `complete` gets from one must carry no
# engine-owned field (D's kv_transfer_params: block ids, host:port, lease).
ROUTERS: set[str] = set()


def assert_no_engine_fields(raw: str) -> None:
    """An answer a client got through the router names no engine-internal field."""
    for name in ENGINE_FIELDS:
        assert f'"{name}"' not in raw, f"engine field {name!r} reached the client: {raw[:300]}"


# Events worth a line in a failure report.
FAILURE_EVENTS = ("reads_failed", "reuse_reads_failed", "writes_failed", "push_failed",
                  "rejections", "recomputes", "sends_expired", "registrations_forged")

# Log lines that say nothing about a failure: route tables, access logs, throughput.
_NOISE = re.compile(r"Route: |\"(GET|POST) /[^\"]*\" 200|loggers\.py|Started server process|"
                    r"Waiting for application|Application startup|Found ulimit")
_WORTH = re.compile(r"WARNING|ERROR|Traceback|Error:|timed out|kvferry (READ|WRITE)")


def engine_log_tails(lines: int = 20, worth: int = 25) -> str:
    """Per live engine: its warning/error/transfer lines, then the last few other lines.

    Kept short (CI shows only part of a long report), warnings first for every engine
    before any tail, so that what went wrong on each engine is visible."""
    logs = []
    for child in STARTED:
        if not child.group_alive():
            continue
        try:
            text = child.log_path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        logs.append((child, [ln for ln in text if not _NOISE.search(ln)]))
    out = []
    for e in ENGINES:
        if not e.child.group_alive():
            continue
        try:
            snap = fetch_engine_stats("127.0.0.1", e.side_port, e.tp, 1.0)
        except HandshakeError as err:
            out.append(f"==== {e.role} {e.url} counters: {err} ====")
            continue
        moved = {k: v for k, v in snap.counters.items() if v}
        out.append(f"==== {e.role} {e.url} counters {moved}; last failures: ====")
        out.extend(f"{ev.name} {ev.key} {ev.detail}"[:300] for ev in
                   [ev for ev in snap.events if ev.name in FAILURE_EVENTS][-10:])
    for child, text in logs:
        hits = [ln for ln in text if _WORTH.search(ln)]
        out.append(f"==== {child.name} {child.log_path.name}: {len(hits)} warning/error/"
                   f"transfer lines, the last {worth} ====")
        out.extend(ln[:300] for ln in hits[-worth:])
    for child, text in logs:
        out.append(f"==== {child.name} {child.log_path.name}: last {lines} lines ====")
        out.extend(ln[:300] for ln in text[-lines:])
    return "\n".join(out)


def wait_for(value: Callable[[], T], ok: Callable[[T], bool], timeout: float, what: str) -> T:
    """``value()`` once ``ok`` holds for it; the test fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not ok(v := value()):
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.1)
    return v


def stats_of(engines: Iterable[Engine]) -> Snapshot:
    """The counters of several engines, summed."""
    return Snapshot.merge(e.stats() for e in engines)


def settled_writes(prefills: Iterable[Engine], since: Snapshot | None, more: int,
                   tid: str | None = None) -> int:
    """How many WRITEs (of ``tid``, or all; summed over ``prefills``) finished since
    ``since`` (None: ever), once ``more`` of them ended, done or failed.

    P counts a WRITE when it next polls it, possibly just after D answered on its
    notification; every WRITE ends within its deadline (recv_timeout_s) either way, so the
    count returned is exact."""
    ps = list(prefills)

    def count(s: Snapshot | None, name: str) -> int:
        if s is None:
            return 0
        return len(s.find(name, tid)) if tid else s[name]

    def ended(s: Snapshot | None) -> int:
        return count(s, "writes_done") + count(s, "writes_failed")

    bound = max(p.cfg.recv_timeout_s for p in ps) + ACT_S
    now = wait_for(lambda: stats_of(ps), lambda s: ended(s) - ended(since) >= more, bound,
                   f"{more} WRITEs {tid or ''} to end on P")
    return count(now, "writes_done") - count(since, "writes_done")


def prompt(n: int, seed: int, vocab: int = 1000) -> list[int]:
    """Deterministic random token ids (no tokenizer needed)."""
    rnd = random.Random(seed)
    return [rnd.randrange(10, vocab) for _ in range(n)]


def wait_until(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


_TINY: list[str] = []  # the session's tiny model, once written


def tiny_model(tmp_path_factory: Any) -> str:
    """The tiny Qwen3 with generated weights that every engine test serves, written once
    per session (the weights are deterministic; each module writing its own cost seconds)."""
    from kvferry.scripts.modelgen import write_model

    if not _TINY:
        _TINY.append(str(write_model(tmp_path_factory.getbasetemp() / "model-tiny", "tiny",
                                     weights=True)))
    return _TINY[0]


@contextmanager
def tiny_stack(tmp_path_factory: Any, extra: dict[str, Any],
               router: dict[str, Any] | None = None) -> Iterator[Stack]:
    """The CPU E2E stack: tiny Qwen3 with generated weights, kvferry on both engines."""
    model = tiny_model(tmp_path_factory)
    with pd_stack(model, tmp_path_factory.mktemp("logs"), extra=extra, router=router) as s:
        yield s



@dataclass
class Engine:
    role: str
    url: str
    child: Child
    side_port: int
    control_port: int = 0
    engine_id: str = ""  # the id vLLM's own NixlConnector engines run under
    tp: int = 1
    cfg: ConnectorConfig = field(default_factory=ConnectorConfig)  # kvferry's settings
    rebound: dict[int, set[int]] = field(default_factory=dict)  # scripts/cpu_pin.py

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a Prometheus sample of this engine (0 if absent)."""
        return metric_at(self.url, name, **labels)

    def kv_usage(self) -> float:
        return self.metric("vllm:kv_cache_usage_perc")

    def stats(self) -> Snapshot:
        """kvferry's transfer counters of this engine, summed over its TP ranks, read live
        from its side channel within its handshake_timeout_s (what its peers wait too)."""
        return fetch_engine_stats("127.0.0.1", self.side_port, self.tp,
                                  self.cfg.handshake_timeout_s)

    def writes(self) -> int:
        """push WRITEs this prefill engine finished (each counted when P next polls it:
        possibly just after D answered; see `settled_writes`)."""
        return self.stats()["writes_done"]

    def transferred_tokens(self) -> float:
        return self.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")

    def log(self) -> str:
        """For failure messages only: tests decide on `stats`, never on log text."""
        return self.child.log_path.read_text(errors="replace")

    def reads(self) -> int:
        """pull READs this engine completed (one per TP rank and request)."""
        return self.stats()["reads_done"]

    def when(self, ok: Callable[[Snapshot], bool], timeout: float, what: str) -> Snapshot:
        """This engine's stats once ``ok`` holds for them; the test fails after ``timeout``."""
        return wait_for(self.stats, ok, timeout, f"{self.role} {self.url}: {what}")


@dataclass
class Stack:
    prefill: Engine
    decode: Engine
    router: str
    secret: str
    model: str
    children: list[Child] = field(default_factory=list)


def start_engine(role: str, model: str, logs: Path, secret: str, connector: str = "kvferry",
                 extra: dict[str, Any] | None = None, cpus: tuple[int, ...] | None = None,
                 backend: str = "cpu", engine_args: tuple[str, ...] = (), mode: str = "pull",
                 devices: tuple[int, ...] | None = None, tp: int = 1,
                 bind: str | None = None, env: dict[str, str] | None = None) -> Engine:
    """``tp`` TP ranks (side ports side..side+tp-1; free_port keeps ports 8 apart);
    ``bind`` overrides the CPU bind string (e.g. "0|1": one core per rank); ``env`` is
    added to the engine's environment."""
    port, side, control = free_port(), free_port(), free_port()
    spec = EngineSpec(role=role, model=model, port=port, connector=connector,  # type: ignore[arg-type]
                      side_channel_port=side, lease_control_port=control, cpus=cpus,
                      connector_extra=extra or {}, mode=mode, devices=devices,  # type: ignore[arg-type]
                      backend=backend, extra_args=engine_args,  # type: ignore[arg-type]
                      devices_per_engine=tp)
    full_env = {**engine_env(spec), "KVFERRY_SECRET": secret, **(env or {})}
    if bind is not None:
        full_env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    child = Child(role, engine_argv(spec), logs / f"{role}-{port}.log",
                  f"http://127.0.0.1:{port}/health", full_env)
    child.start()
    STARTED.append(child)
    engine = Engine(role, f"http://127.0.0.1:{port}", child, side, control,
                    vllm_engine_id(spec), tp, ConnectorConfig.from_extra(extra)
                    if connector == "kvferry" else ConnectorConfig())
    if connector == "kvferry":
        ENGINES.append(engine)
    return engine


def warm_up(engines: list[Engine], model: str) -> None:
    """An engine's first forward is slow (kernel set-up) and starves its side-channel
    thread: warm every engine up before the transfers' handshakes depend on it."""
    with ThreadPoolExecutor(len(engines)) as pool:
        list(pool.map(lambda e: complete(e.url, model, prompt(200, 0), max_tokens=2), engines))


def serve_kvferry_router(es: ExitStack, prefills: list[Engine], decodes: list[Engine],
                         secret: str, **kw: Any) -> str:
    """The router over kvferry engines (generous leg timeouts for CPU CI; `kw`: more
    RouterSettings), until ``es`` closes; its URL."""
    settings = kvferry_router_settings(prefills, decodes, prefill_timeout_s=300,
                                       decode_timeout_s=300, **kw)
    url = es.enter_context(serve(create_app(settings, secret.encode())))
    ROUTERS.add(url)
    return url


def kvferry_router_settings(prefills: list[Engine], decodes: list[Engine], **kw: Any
                            ) -> RouterSettings:
    """Router settings for kvferry engines: every P's side channel (push) and every D's
    lease-control address (conversation reuse), in the engines' order."""
    return RouterSettings(
        prefill_urls=[p.url for p in prefills], decode_urls=[d.url for d in decodes],
        prefill_kv_addrs=[f"127.0.0.1:{p.side_port}" for p in prefills],
        decode_control_addrs=[f"127.0.0.1:{d.control_port}" for d in decodes], **kw)


@contextmanager
def pd_stack(model: str, logs: Path, connector: str = "kvferry",
             extra: dict[str, Any] | None = None, backend: str = "cpu",
             engine_args: tuple[str, ...] = (), prefill_args: tuple[str, ...] = (),
             router: dict[str, Any] | None = None, mode: str = "pull",
             decode_args: tuple[str, ...] = (),
             devices: tuple[tuple[int, ...] | None, tuple[int, ...] | None] = (None, None),
             ) -> Iterator[Stack]:
    """P + D + router. `mode` picks vLLM's connector class for connector="vllm-nixl"
    (push: NixlPushConnector, which the router drives with P's engine id)."""
    with ExitStack() as stack:
        s = start_pd(stack, model, logs, connector, extra, backend, engine_args + prefill_args,
                     engine_args + decode_args, mode, devices)
        yield with_router(stack, s, router, connector, mode)


def start_pd(es: ExitStack, model: str, logs: Path, connector: str = "kvferry",
             extra: dict[str, Any] | None = None, backend: str = "cpu",
             prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = (),
             mode: str = "pull",
             devices: tuple[tuple[int, ...] | None, tuple[int, ...] | None] = (None, None),
             ) -> Stack:
    """P and D, healthy, stopped when ``es`` closes; no router yet (``router`` is "")."""
    secret = secrets.token_hex(16)
    p = start_engine("prefill", model, logs, secret, connector, extra, None, backend,
                     prefill_args, mode, devices[0])
    d = start_engine("decode", model, logs, secret, connector, extra, None, backend,
                     decode_args, mode, devices[1])
    children = [p.child, d.child]
    es.callback(stop_all, children)
    wait_healthy(children, STARTUP_S)
    if connector == "vllm-nixl" and backend == "cpu":
        for e in (p, d):  # vLLM's NIXL worker put both forwards on the last core
            e.rebound = restore_worker_binding(e.child)
    return Stack(p, d, "", secret, model, children)


def with_router(es: ExitStack, s: Stack, router: dict[str, Any] | None = None,
                connector: str = "kvferry", mode: str = "pull") -> Stack:
    """``s`` behind a new in-process router (``router``: more RouterSettings), served until
    ``es`` closes; the engines are shared with ``s``."""
    p, d = s.prefill, s.decode
    vllm_push = connector == "vllm-nixl" and mode == "push"
    kv = [f"127.0.0.1:{p.side_port}"] if connector == "kvferry" or vllm_push else []
    ctl = [f"127.0.0.1:{d.control_port}"] if connector == "kvferry" else []
    ids = [p.engine_id] if vllm_push else []
    settings = RouterSettings(prefill_urls=[p.url], decode_urls=[d.url], prefill_kv_addrs=kv,
                              decode_control_addrs=ctl, prefill_engine_ids=ids,
                              prefill_timeout_s=120, decode_timeout_s=120,
                              **({"mode": "push"} if vllm_push else {}), **(router or {}))
    url = es.enter_context(serve(create_app(settings, s.secret.encode())))
    ROUTERS.add(url)
    return replace(s, router=url)


def complete(url: str, model: str, prompt: list[int], max_tokens: int = 12,
             timeout: float = 180, **extra: Any) -> dict[str, Any]:
    """Greedy /v1/completions with token ids and top-5 logprobs."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 5, "return_token_ids": True, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
    r.raise_for_status()
    if url in ROUTERS:
        assert_no_engine_fields(r.text)
    return r.json()


def tokens_and_logprobs(resp: dict[str, Any]) -> tuple[list[int], list[dict[str, float]]]:
    choice = resp["choices"][0]
    return list(choice["token_ids"]), list(choice["logprobs"]["top_logprobs"])


# A colocated engine computes the last prompt token inside its prefill kernel; D computes
# it alone against cached KV: bf16 rounding moves the first token's logprobs by up to
# ~0.1 (seen 0.06) and later steps compound it, so against colocated runs the logprobs of
# the first token are compared within COLOCATED_TOL (plus every greedy token exactly).
# Two disaggregated paths that load the same KV (pull vs push) agree to the bit (tol=0).
COLOCATED_TOL = 0.15


def metric_at(url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample on ``url``'s /metrics (an engine, a router; 0 if absent)."""
    return sample_sum(httpx.get(url + "/metrics", timeout=10).text, name, **labels)


def sample_sum(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample in one /metrics answer (0 if absent): several samples
    read from the same answer belong to the same moment."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith((name + "{", name + " ")):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def assert_same_output(got: dict[str, Any], want: dict[str, Any], first: int = 1,
                       tol: float = COLOCATED_TOL) -> None:
    """Greedy tokens identical; top-5 logprobs of the first tokens equal within ``tol``.

    Greedy tokens of a random model turn periodic after a few steps, so the logprobs of
    the first tokens are what catches a wrong or partial KV block.
    """
    gt, gl = tokens_and_logprobs(got)
    wt, wl = tokens_and_logprobs(want)
    assert gt == wt, f"tokens differ: {gt} != {wt}"
    for i in range(min(first, len(wl))):
        g, w = gl[i], wl[i]
        for tok in g.keys() & w.keys():
            assert abs(g[tok] - w[tok]) <= tol, f"logprob of {tok!r} at step {i}: {g[tok]} vs {w[tok]}"
        # A token in only one top-5 must be a near-tie at the cut-off (within tol of the
        # other side's 5th logprob), never a different distribution.
        for a, b in ((g, w), (w, g)):
            for tok in a.keys() - b.keys():
                assert a[tok] <= min(b.values()) + tol, f"top-5 at step {i}: {g} != {w}"


def outputs_differ(got: dict[str, Any], want: dict[str, Any], tol: float = COLOCATED_TOL) -> bool:
    try:
        assert_same_output(got, want, tol=tol)
    except AssertionError:
        return True
    return False
