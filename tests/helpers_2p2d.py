"""Two prefill + two decode vLLM CPU engines behind one kvferry router: the stack of
tests/test_e2e_2p2d.py and of its stress loop tests/chaos/stress_2p2d.py.

Layout: one core per engine on hosts with 4+ cores; with fewer, both P on the first core
and both D on the last (tests/stack.py's CORE_RULE: no P shares a core with a D). P
engines run without prefix caching so that conversation turns must READ their history
from D.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from helpers_http import OPERATOR
from stack import STARTUP_S, Engine, complete, serve_kvferry_router, start_engine, warm_up

from kvferry.scripts.engines import available_cpus
from kvferry.scripts.procs import stop_all, wait_healthy

SHARED_CORES = len(available_cpus()) < 4

# Engines that share cores are slow: timeouts generous enough that a slow (not stalled)
# transfer does not fall back to recompute.
EXTRA = {"handshake_timeout_s": 60, "recv_timeout_s": 90, "send_timeout_s": 120,
         "push_hold_timeout_s": 60, "push_register_timeout_s": 60, "push_recv_timeout_s": 90,
         "push_quarantine_s": 1, "lease_free_grace_s": 10, "lease_margin_s": 10,
         "reuse_read_timeout_s": 8}

SPREAD_JOBS = tuple((n, "pull" if i % 2 == 0 else "push")
                    for i, n in enumerate((200, 700, 129, 400, 500, 300)))
"""The spread scenario's six concurrent requests, (prompt length, mode): three pulls and
three pushes interleaved."""


@dataclass
class Cluster:
    prefills: list[Engine]
    decodes: list[Engine]
    router: str
    model: str

    @property
    def engines(self) -> list[Engine]:
        return self.prefills + self.decodes

    def colocated(self, toks: list[int]) -> dict:
        """The reference: P0 serves the whole request itself (no kv params)."""
        return complete(self.prefills[0].url, self.model, toks)


def start_cluster(es: ExitStack, model: str, logs: Path, secret: str, *, warm: bool = True,
                  one_core: bool = False, **router: Any) -> Cluster:
    """Start the four engines (stopped when ``es`` closes) and the router (``router``:
    its settings). ``one_core`` pins all four to one core: a slower, busier CI runner."""
    cpus = available_cpus()
    if one_core:
        p_cpus, d_cpus = (cpus[0], cpus[0]), (cpus[0], cpus[0])
    elif SHARED_CORES:  # both P on the first core, both D on the last (CORE_RULE)
        p_cpus, d_cpus = (cpus[0], cpus[0]), (cpus[-1], cpus[-1])
    else:
        p_cpus, d_cpus = (cpus[0], cpus[1]), (cpus[2], cpus[3])
    children: list = []
    es.callback(stop_all, children)

    def start(role: str, cpu: int, args: tuple[str, ...] = ()) -> Engine:
        e = start_engine(role, model, logs, secret, extra=EXTRA, cpus=(cpu,), engine_args=args)
        children.append(e.child)
        return e

    no_cache = ("--no-enable-prefix-caching",)
    ps = [start("prefill", c, no_cache) for c in p_cpus]
    ds = [start("decode", c) for c in d_cpus]
    wait_healthy(children, STARTUP_S)
    if warm:
        warm_up(ps + ds, model)
    return Cluster(ps, ds, serve_kvferry_router(es, ps, ds, secret, **router), model)


def send(cluster: Cluster, toks: list[int], mode: str, cid: str | None = None
         ) -> tuple[dict, httpx.Headers]:
    """One completion through the router in ``mode`` (pull/push), greedy, with logprobs."""
    body = {"model": cluster.model, "prompt": toks, "max_tokens": 12, "temperature": 0,
            "logprobs": 5, "return_token_ids": True}
    if cid is not None:
        body["conversation_id"] = cid
    r = httpx.post(cluster.router + "/v1/completions", json=body, timeout=400,
                   headers={"x-kvferry-mode": mode, **OPERATOR})
    r.raise_for_status()
    return r.json(), r.headers
