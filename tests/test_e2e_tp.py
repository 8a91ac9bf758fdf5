"""Engines of different TP sizes, end to end: P TP 2 -> D TP 1 and P TP 1 -> D TP 2 (one
KV head per rank of a TP-2 engine; P's ranks on the first core, D's on the last); real
vLLM CPU engines with kvferry's connector, behind the router; pull, push and conversation
reuse.

P TP 2 -> D TP 1. Pull: D's one rank READs head 0 from P's rank 0 and head 1 from P's
rank 1 (tp_map.plan). Push: each P rank WRITEs its head into D's blocks; D waits for both.
Reuse: each P rank READs its head of the lease back from D. P TP 1 -> D TP 2 mirrors it:
each D rank READs its head from P's one rank, P's rank WRITEs each head to its D rank, and
reuse READs both D ranks into P's one. A missing or misplaced head
changes the first tokens' logprobs far beyond the tolerance.
The reference is the TP-1 engine serving the prompt alone (D for P TP 2, P for D TP 2).
A TP-2 engine's all-reduce sums in another order: bf16 values move by an ulp here and
there. Measured per prompt (100/300/700 tokens), first-step top-5 logprobs: TP-1 engine
alone vs TP-2 engine alone up to 1.125 (100 tokens); the mixed pair vs the TP-1 engine
alone up to 0.187 (P TP 2 -> D TP 1) and 0.101 (P TP 1 -> D TP 2), vs the TP-2 engine alone
up to 1.0 and 1.125: a pair with one TP-1 engine follows that engine's numbers, hence the
reference and TP_TOL. Push and pull move the same bytes, so they agree to the bit (tol 0).
"""

from __future__ import annotations

import secrets
from contextlib import ExitStack

import pytest
from helpers_tp import TP_TOL, routed
from stack import (
    STARTUP_S,
    Engine,
    assert_same_output,
    complete,
    prompt,
    serve_kvferry_router,
    settled_writes,
    start_engine,
    tiny_model,
    wait_until,
    warm_up,
)

from kvferry.connectors.memory.backends import KVLayout
from kvferry.connectors.transfer.handshake import fetch
from kvferry.scripts.engines import available_cpus
from kvferry.scripts.procs import stop_all, wait_healthy

pytestmark = pytest.mark.engine

EXTRA = {"recv_timeout_s": 60, "handshake_timeout_s": 45, "send_timeout_s": 120}


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["p2-d1", "p1-d2"])
def stack(request, tmp_path_factory):
    """(P, D, router, model): P's TP ranks share the first core, D's the last one
    (tests/stack.py's CORE_RULE: D sharing a core with P's rank 1 stalled first pulls; D
    TP 2 with its second rank on P's core took 10-60+ s per first READ)."""
    model = tiny_model(tmp_path_factory)
    logs = tmp_path_factory.mktemp("logs")
    secret = secrets.token_hex(16)
    p_tp, d_tp = request.param
    first, last = available_cpus()[0], available_cpus()[-1]
    binds = {"prefill": "|".join([str(first)] * p_tp), "decode": "|".join([str(last)] * d_tp)}
    with ExitStack() as es:
        p = start_engine("prefill", model, logs, secret, extra=EXTRA, tp=p_tp, bind=binds["prefill"],
                         engine_args=("--no-enable-prefix-caching",))  # reuse reads D's KV
        # No prefix cache on D: its colocated reference must not reuse transferred KV.
        d = start_engine("decode", model, logs, secret, extra=EXTRA, tp=d_tp, bind=binds["decode"],
                         engine_args=("--no-enable-prefix-caching",))
        children = [p.child, d.child]
        es.callback(stop_all, children)
        wait_healthy(children, STARTUP_S)
        warm_up([p, d], model)
        router = serve_kvferry_router(es, [p], [d], secret,  # turns via P: D -> P reuse
                                      d_local_max_new_tokens=0)
        yield p, d, router, model


def tp1(p: Engine, d: Engine) -> Engine:
    """The reference engine: the pair's TP-1 engine (the module docstring says why)."""
    return p if p.tp == 1 else d


@pytest.mark.parametrize("n", [100, 300, 700])
def test_mixed_tp_equals_the_tp1_engine_alone(stack, n):
    p, d, router, model = stack
    toks = prompt(n, 40 + n)
    want = complete(tp1(p, d).url, model, toks)  # serves it alone: no remote params
    before = d.transferred_tokens()
    got = complete(router, model, toks)
    assert d.transferred_tokens() - before == n, "D must load every prompt token"
    assert_same_output(got, want, tol=TP_TOL)


@pytest.mark.parametrize("n", [100, 700])
def test_push_from_every_prefill_rank(stack, n):
    p, d, router, model = stack
    toks = prompt(n, 90 + n)
    want = complete(tp1(p, d).url, model, toks)
    pulled, _ = routed(router, model, toks, "pull")
    p0, d0, loaded = p.stats(), d.stats(), d.transferred_tokens()
    got, _ = routed(router, model, toks, "push")
    assert_same_output(got, pulled, tol=0)  # the same bytes as pull's READs
    assert_same_output(got, want, tol=TP_TOL)
    # Each P rank counts one WRITE per push (its transfers to every D rank it serves).
    assert settled_writes([p], p0, p.tp) == p.tp, "one WRITE per P rank"
    d1 = d.stats()  # each D rank counts the push before it decodes: exact at its answer
    assert d1["push_received"] - d0["push_received"] == d.tp
    assert d1["recomputes"] == d0["recomputes"], d1.events[-5:]
    assert d.transferred_tokens() - loaded == n, "D must load every prompt token"


def test_conversation_reuse_reads_decode_kv_into_every_prefill_rank(stack):
    p, d, router, model = stack
    first = prompt(300, 77)
    r1, _ = routed(router, model, first, "pull", cid="tp-conv")
    toks = first + list(r1["choices"][0]["token_ids"]) + prompt(150, 78)
    reads = p.stats()["reuse_reads_done"]
    r2, headers = routed(router, model, toks, "pull", cid="tp-conv")
    assert int(headers.get("x-kvferry-reused-tokens", 0)) >= 128  # D's full blocks
    # Each P rank counts its READ before P computes the rest: exact at the answer.
    assert p.stats()["reuse_reads_done"] == reads + p.tp, "each P rank read its heads"
    assert_same_output(r2, complete(tp1(p, d).url, model, toks), tol=TP_TOL)


def test_every_prefill_rank_was_read_and_freed(stack):
    p, d, router, model = stack
    s = d.stats()
    assert s["reads_failed"] == 0, f"a READ failed and D recomputed: {s.find('reads_failed')}"
    assert s["reads_done"] >= 3 * d.tp  # one per D rank and request
    for e in (p, d):  # every rank located its share of the tiny model's 2 KV heads
        for r in range(e.tp):
            info = fetch("127.0.0.1", e.side_port + r, e.cfg.handshake_timeout_s)
            assert KVLayout.from_wire(info["layout"]).num_heads == 2 // e.tp, (e.role, r)
    # every rank heard D's notice: P's blocks are free
    wait_until(lambda: p.kv_usage() == 0.0, 30, "P's blocks to be freed")
    assert p.stats()["sends_expired"] == 0, "P freed an offer nobody read"
    assert p.stats()["thread_errors"] == s["thread_errors"] == 0
