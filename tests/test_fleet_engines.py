"""The router fleet on real vLLM CPU engines: two router replicas (real `kvferry router`
processes) sharing conversations in a real `redis-server`, in front of 1P1D, and a second
D that joins through the engines file (1P2D: four engines, as the 2P2D tests run, would
leave each of CI's two cores with two engines plus the routers; killing a P is covered by
the fake-engine retry tests).

Order matters (one module-scoped fleet): a conversation alternating replicas; a replica
SIGKILLed mid-conversation and restarted; Redis SIGKILLed and restarted; D1 added by the
engines file; a D SIGKILLed mid-stream. Every greedy output is compared with a colocated
run on P. P runs without prefix caching, so each turn's history comes from D's KV (READ
back under D's lease) or is recomputed: reused tokens are read off the routers' and P's
metrics.
"""

from __future__ import annotations

import json
import secrets
import signal
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fleet_stack import RedisServer, RouterProcess, wait_for
from helpers_http import OPERATOR, engine_name
from helpers_reuse import expected_reuse, out_tokens
from stack import (
    STARTUP_S,
    Engine,
    assert_no_engine_fields,
    assert_same_output,
    complete,
    prompt,
    sample_sum,
    start_engine,
    warm_up,
)

from kvferry.connectors.transfer import faults
from kvferry.router.settings import RouterSettings
from kvferry.scripts.engines import available_cpus
from kvferry.scripts.procs import stop_all, wait_healthy

pytestmark = pytest.mark.engine

# Engines share two cores with each other and the routers: timeouts generous enough that
# a slow (not stalled) transfer does not fall back to recompute (as tests/test_e2e_2p2d.py).
EXTRA = {"handshake_timeout_s": 60, "recv_timeout_s": 90, "send_timeout_s": 120,
         "lease_free_grace_s": 10, "lease_margin_s": 10, "reuse_read_timeout_s": 8}
# A Redis call waits for a core behind three busy engines: past the 100 ms default it
# (correctly) means "no reuse this turn", which is not what these turns test.
STATE_TIMEOUT_S = 1.0
BACKOFF_S = RouterSettings.model_fields["state_retry_s"].default
"""After a failed Redis call a router leaves Redis alone this long (not a CLI flag)."""
DISCOVERY_S = RouterSettings.model_fields["discovery_interval_s"].default


@dataclass
class Fleet:
    p: Engine
    d0: Engine
    d1: Engine
    a: RouterProcess
    b: RouterProcess
    redis: RedisServer
    engines_file: Path
    model: str
    faults_plan: Path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from kvferry.scripts.modelgen import write_model

    model = str(write_model(tmp_path_factory.mktemp("model") / "tiny", "tiny", weights=True))
    logs = tmp_path_factory.mktemp("logs")
    secret = secrets.token_hex(16)
    cpus = available_cpus()
    with ExitStack() as stack:
        children: list = []
        stack.callback(stop_all, children)

        plan = logs / "faults.json"  # the decode engines' fault plan: empty until a test
        plan.write_text(json.dumps({"rules": []}))  # slows them (DecodeKiller)

        def start(role: str, cpu: int, args: tuple[str, ...] = ()) -> Engine:
            env = {faults.ENV: str(plan), faults.TAG_ENV: "decode"} if role == "decode" else {}
            e = start_engine(role, model, logs, secret, extra=EXTRA, cpus=(cpu,),
                             engine_args=args, env=env)
            children.append(e.child)
            return e

        p = start("prefill", cpus[0], ("--no-enable-prefix-caching",))
        d0 = start("decode", cpus[-1])
        d1 = start("decode", cpus[-1])  # joins the routers later, through the engines file
        redis = RedisServer()
        redis.start()
        stack.callback(redis.stop)
        wait_healthy(children, STARTUP_S)
        warm_up([p, d0, d1], model)
        engines_file = logs / "engines.json"
        engines_file.write_text(json.dumps({"decode": []}))
        args = ["--prefill", p.url, "--prefill-kv", f"127.0.0.1:{p.side_port}",
                "--decode", d0.url, "--decode-control", f"127.0.0.1:{d0.control_port}",
                "--state", redis.url, "--state-timeout", str(STATE_TIMEOUT_S),
                "--engines-file", str(engines_file), "--health-interval", "1"]
        a, b = (RouterProcess(args, secret, logs / f"router-{n}.log") for n in "ab")
        for r in (a, b):
            stack.callback(r.kill)
            r.start()
        yield Fleet(p, d0, d1, a, b, redis, engines_file, model, plan)


def turn(router: RouterProcess, fleet: Fleet, toks: list[int], cid: str | None
         ) -> tuple[dict, httpx.Headers]:
    body = {"model": fleet.model, "prompt": toks, "max_tokens": 12, "temperature": 0,
            "logprobs": 5, "return_token_ids": True}
    if cid is not None:
        body["conversation_id"] = cid
    r = httpx.post(router.url + "/v1/completions", json=body, timeout=300, trust_env=False,
                   headers=OPERATOR)
    r.raise_for_status()
    assert_no_engine_fields(r.text)
    resp = r.json()
    assert_same_output(resp, complete(fleet.p.url, fleet.model, toks))  # colocated
    return resp, r.headers


class Conversation:
    """Turns of one conversation: each prompt is the last one, its answer and new text."""

    def __init__(self, fleet: Fleet, cid: str, seed: int) -> None:
        self.fleet, self.cid, self.seed = fleet, cid, seed
        self.hist: list[tuple[list[int], dict]] = []

    def next_prompt(self) -> list[int]:
        if not self.hist:
            return prompt(300, self.seed)
        toks, resp = self.hist[-1]
        return toks + out_tokens(resp) + prompt(150, self.seed * 100 + len(self.hist))

    def turn(self, router: RouterProcess) -> tuple[int, int]:
        """One turn on `router`: (tokens reused, by the router's metrics and P's own, the
        reuse the previous turn's KV on D allows)."""
        toks = self.next_prompt()
        want = expected_reuse(self.hist[-1][0], out_tokens(self.hist[-1][1]), toks) \
            if self.hist else 0
        name = "kvferry_router_reused_tokens_total"
        before, p_before = router.metric(name), self.fleet.p.transferred_tokens()
        resp, headers = turn(router, self.fleet, toks, self.cid)
        self.hist.append((toks, resp))
        got = router.metric(name) - before
        assert self.fleet.p.transferred_tokens() - p_before == got  # P agrees
        assert int(headers.get("x-kvferry-reused-tokens", 0)) == got
        return int(got), want


def test_alternating_replicas_reuse_every_turn(fleet: Fleet) -> None:
    conv = Conversation(fleet, "conv-alt", seed=1)
    assert conv.turn(fleet.a) == (0, 0)
    for router in (fleet.b, fleet.a, fleet.b):
        got, want = conv.turn(router)
        assert want >= 256 and got == want, (got, want)
    for r in (fleet.a, fleet.b):
        assert r.metric("kvferry_router_state_errors_total") == 0
        assert r.metric("kvferry_router_reuse_turns_total", reason="ok") >= 1


@pytest.fixture(scope="module")
def conv_kill(fleet: Fleet) -> Conversation:
    """The conversation that outlives a replica, then Redis."""
    return Conversation(fleet, "conv-kill", seed=2)


def test_killed_replica_next_turn_on_the_other_reuses(fleet: Fleet, conv_kill) -> None:
    conv = conv_kill
    conv.turn(fleet.a)
    conv.turn(fleet.a)
    fleet.a.kill()  # SIGKILL: nothing it held in memory survives
    got, want = conv.turn(fleet.b)
    assert want > 0 and got == want
    fleet.a.start()  # a fresh replica knows the conversation from Redis alone
    got, want = conv.turn(fleet.a)
    assert want > 0 and got == want


def test_redis_down_no_reuse_then_back(fleet: Fleet, conv_kill: Conversation) -> None:
    conv = conv_kill
    fleet.redis.stop()
    errors = fleet.b.metric("kvferry_router_state_errors_total")
    got, _ = conv.turn(fleet.b)
    assert got == 0  # answered (equal to colocated), without the history's KV
    assert fleet.b.metric("kvferry_router_state_errors_total") > errors
    assert fleet.b.metric("kvferry_router_state_up") == 0
    fleet.redis.start()  # empty: no persistence
    time.sleep(BACKOFF_S)  # the replica's back-off after the failed call
    got, _ = conv.turn(fleet.b)  # nothing stored yet: recompute, and this turn is stored
    assert got == 0 and fleet.b.metric("kvferry_router_state_up") == 1
    got, want = conv.turn(fleet.a)
    assert want > 0 and got == want


def test_engine_added_through_the_engines_file_gets_work(fleet: Fleet) -> None:
    tmp = fleet.engines_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"decode": [
        {"url": fleet.d1.url, "control_addr": f"127.0.0.1:{fleet.d1.control_port}"}]}))
    tmp.replace(fleet.engines_file)

    def serving(r: RouterProcess) -> list[str]:
        return [d["url"] for d in httpx.get(r.url + "/health", timeout=5,
                                            headers=OPERATOR).json()["decode"]
                if d["state"] == "healthy"]

    # A discovered engine is "starting" (work only when no engine is healthy) until its
    # first health probe answers: wait for that, not only for the discovery.
    for r in (fleet.a, fleet.b):
        wait_for(lambda r=r: fleet.d1.url in serving(r), 10 * DISCOVERY_S, "D1 serving")
    served = []
    for i in range(2):  # least in flight, ties round-robin: one of two goes to D1
        _, headers = turn(fleet.b, fleet, prompt(200, 40 + i), None)
        served.append(headers["x-kvferry-decode"])
    assert fleet.d1.url in served, served
    assert fleet.b.metric("kvferry_router_discovery_changes_total", role="decode",
                          change="added") == 1


# D must still be decoding when it is killed. A kill decided on the client's token count
# lands as late as the client (and the router before it) are behind D, and one decided on
# D's /metrics as late as D's API server is behind its engine core: CI runs on two busy
# cores saw D finish all of its 1,200 tokens first, both ways, and the stream then needed
# no migration. So for this stream the decode engines' steps are slowed (a `step` delay in
# their fault plan: STEP_DELAY_S x KILLED_STREAM_TOKENS is the window), and a thread kills
# the serving D once its counters show KILL_AFTER tokens of the stream generated and the
# request still running (both from one /metrics answer), then lifts the delay.
KILLED_STREAM_TOKENS = 600
KILL_AFTER = 30
STEP_DELAY_S = 0.03


class DecodeKiller(threading.Thread):
    """SIGKILLs ``victim`` once its generated tokens passed ``base + KILL_AFTER`` while
    it was still running a request; ``seen`` keeps what the deciding read showed."""

    def __init__(self, victim: Engine, plan: Path) -> None:
        super().__init__(daemon=True)
        self.victim, self.plan = victim, plan
        self.base = self._read()[0]
        self.seen: tuple[float, float] | None = None

    def _read(self) -> tuple[float, float]:
        text = httpx.get(self.victim.url + "/metrics", timeout=10, trust_env=False).text
        return (sample_sum(text, "vllm:generation_tokens_total"),
                sample_sum(text, "vllm:num_requests_running"))

    def run(self) -> None:
        try:
            self._watch()
        finally:
            slow_decode(self.plan, False)  # the stream goes on elsewhere at full speed

    def _watch(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            generated, running = self._read()
            # (before its first token D may not run the request yet: it waits for P's KV)
            if generated - self.base >= KILL_AFTER or (generated > self.base and running == 0):
                self.seen = (generated - self.base, running)
                if running >= 1:
                    self.victim.child.signal_group(signal.SIGKILL)
                return
            time.sleep(0.02)


def slowed_steps(plan: Path) -> int:
    """Decode steps the ``step`` rule has delayed so far (the engines' fault events)."""
    return sum(ln.count('"point": "step"') for f in (plan.parent / "hits").glob("*.jsonl")
               for ln in f.read_text().splitlines())


def slow_decode(plan: Path, on: bool) -> None:
    """The decode engines' steps take STEP_DELAY_S longer (``on``), or run at full speed;
    an engine reads its plan again within `faults.RELOAD_S`."""
    rules = [{"point": "step", "action": "delay", "p": 1.0, "s": STEP_DELAY_S}] if on else []
    tmp = plan.with_suffix(".tmp")
    tmp.write_text(json.dumps({"seed": 1, "rules": rules, "events": str(plan.parent / "hits")}))
    tmp.replace(plan)


def test_decode_killed_mid_stream_continues_token_for_token(fleet: Fleet) -> None:
    toks = prompt(260, 50)
    n = KILLED_STREAM_TOKENS
    body = {"model": fleet.model, "prompt": toks, "max_tokens": n, "temperature": 0,
            "stream": True, "return_token_ids": True, "ignore_eos": True}

    def run(kill: bool) -> tuple[list[int], str, bytes, DecodeKiller | None]:
        ids: list[int] = []
        with httpx.stream("POST", fleet.b.url + "/v1/completions", json=body, timeout=300,
                          trust_env=False, headers=OPERATOR) as r:
            assert r.status_code == 200
            served = r.headers["x-kvferry-decode"]
            killer = None
            if kill:
                killer = DecodeKiller(next(e for e in (fleet.d0, fleet.d1) if e.url == served),
                                      fleet.faults_plan)
                killer.start()
            raw = b""
            for line in r.iter_lines():
                raw += line.encode() + b"\n"
                if not line.startswith("data: {"):
                    continue
                for c in json.loads(line[6:]).get("choices", []):
                    ids += c.get("token_ids") or []
        if killer is not None:
            killer.join(10)
        return ids, served, raw, killer

    whole, _, _, _ = run(False)  # uninterrupted, through the same router
    colocated = complete(fleet.p.url, fleet.model, toks, max_tokens=n,
                         ignore_eos=True)["choices"][0]
    assert len(whole) == n and whole == colocated["token_ids"]
    migrations = {r: fleet.b.metric("kvferry_router_migrations_total", result=r)
                  for r in ("ok", "finished")}
    slow_decode(fleet.faults_plan, True)
    try:
        got, killed, raw, killer = run(True)
    finally:
        slow_decode(fleet.faults_plan, False)
    assert killer is not None and killer.seen is not None, "D's counters never moved"
    generated, running = killer.seen
    assert running >= 1, f"D had finished ({generated:.0f} tokens) before it could be killed"
    assert slowed_steps(fleet.faults_plan) >= KILL_AFTER  # the window was open
    assert b'"error"' not in raw and raw.rstrip().endswith(b"data: [DONE]")
    assert_no_engine_fields(raw.decode())
    assert got == whole  # one stream, token for token
    assert fleet.b.metric("kvferry_router_migrations_total", result="finished") == \
        migrations["finished"], "D had sent its last token before the kill landed"
    assert fleet.b.metric("kvferry_router_migrations_total", result="ok") == \
        migrations["ok"] + 1
    assert fleet.b.metric("kvferry_router_migrated_tokens_total") >= 6
    wait_for(lambda: not next(e for e in (fleet.d0, fleet.d1)
                              if e.url == killed).child.group_alive(), 10, "D dead")


def test_killed_decode_restarted_is_readmitted_and_gets_work(fleet: Fleet) -> None:
    """After the previous test's SIGKILL: the same D started again on its port answers
    the routers' probes, is re-admitted, and serves requests again (colocated answers)."""
    dead = next(e for e in (fleet.d0, fleet.d1) if not e.child.group_alive())
    name = engine_name(fleet.b.url, dead.url)
    assert fleet.b.metric("kvferry_router_upstream_healthy", role="decode",
                          upstream=name) == 0
    back0 = fleet.b.metric("kvferry_router_readmissions_total", role="decode",
                           upstream=name)
    dead.child.start()  # same command line, port and side channel
    wait_healthy([dead.child], STARTUP_S)
    wait_for(lambda: fleet.b.metric("kvferry_router_upstream_healthy", role="decode",
                                    upstream=name) == 1, 30, "D re-admitted")
    assert fleet.b.metric("kvferry_router_readmissions_total", role="decode",
                          upstream=name) == back0 + 1
    served = [turn(fleet.b, fleet, prompt(200, 60 + i), None)[1]["x-kvferry-decode"]
              for i in range(2)]  # least in flight, ties round-robin: one goes to it
    assert dead.url in served, served
