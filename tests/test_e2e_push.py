"""Push end to end on real vLLM CPU engines: D registers its blocks while P computes, P
WRITEs them from its transfer thread. Both orders of {registration, prefill done} are
forced deterministically; failures end in a local recompute with blocks freed.

These engines run layer-wise push (``layerwise_push``): a registration that reaches P
before the prompt's last chunk is written layer by layer from vLLM's save_kv_layer; one
that comes later takes the whole-request WRITE. Whole-request early push on real engines
is the default everywhere else (2P2D, the router, chaos, reuse).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from contextlib import ExitStack

import httpx
import pytest
from helpers_sse import strict_events
from shared_stacks import PD, shared
from stack import (
    STARTUP_S,
    assert_same_output,
    complete,
    free_port,
    metric_at,
    prompt,
    settled_writes,
    start_engine,
    wait_until,
    with_router,
)

from kvferry.scripts.procs import stop_all, wait_healthy

# The "pd" pair, shared with test_e2e_pull.py (which runs after this module).
pytestmark = [pytest.mark.engine, pytest.mark.shared_stack("pd")]

EXTRA = PD.extra


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = shared("pd", PD, tmp_path_factory)
    with ExitStack() as es:
        yield with_router(es, s)


def legs(stack, port: int | None = None) -> tuple[str, dict, dict]:
    tid = uuid.uuid4().hex
    p = {"do_remote_decode": True, "push": True, "transfer_id": tid}
    d = {"do_remote_prefill": True, "push": True, "transfer_id": tid,
         "remote_host": "127.0.0.1", "remote_port": port or stack.prefill.side_port}
    return tid, p, d


def run_d(stack, toks, params, out: dict) -> threading.Thread:
    def go():
        out["resp"] = complete(stack.decode.url, stack.model, toks, kv_transfer_params=params,
                               timeout=120)
        out["t"] = time.monotonic()
    th = threading.Thread(target=go)
    th.start()
    return th


def registered(stack, tid: str, timeout: float = EXTRA["push_recv_timeout_s"]) -> None:
    """P received D's registration for ``tid`` (D waits for P's WRITE no longer than its
    push_recv_timeout_s: later, the registration cannot matter)."""
    stack.prefill.when(lambda s: s.find("registrations", tid), timeout,
                       f"D's registration of {tid}")


def writes(stack, tid: str, ended: int = 1) -> int:
    """P's finished WRITEs of `tid`, once `ended` of them ended (`settled_writes`)."""
    return settled_writes([stack.prefill], None, ended, tid)


@pytest.mark.parametrize("n", [200, 1500])
def test_registration_first(stack, n):
    toks = prompt(n, n)
    want = complete(stack.prefill.url, stack.model, toks)
    tid, p, d = legs(stack)
    reads = stack.decode.reads()
    before = stack.prefill.stats()
    out: dict = {}
    th = run_d(stack, toks, d, out)
    registered(stack, tid)  # D registered before P computed
    complete(stack.prefill.url, stack.model, toks, max_tokens=1, kv_transfer_params=p)
    th.join(60)
    assert_same_output(out["resp"], want)
    assert writes(stack, tid) == 1
    assert stack.decode.reads() == reads, "push must not fall back to pull"
    # Registered before the last chunk began: written layer by layer (4 layers; how many
    # went before the CPU forward returned depends on the GIL, so only the path is asserted).
    after = stack.prefill.stats()
    assert after["layered_writes"] - before["layered_writes"] == 1
    assert after["layer_batches"] > before["layer_batches"]
    # vLLM 0.32's save_kv_layer reported each of the tiny model's 4 layers, once, in the
    # step that computed the prompt's last chunk.
    assert after["layer_fences"] - before["layer_fences"] == 4
    # Pull of the same prompt loads the same KV: D's outputs must agree to the bit.
    pulled = complete(stack.router, stack.model, toks)
    assert_same_output(out["resp"], pulled, first=4, tol=0.0)


def test_prefill_first(stack):
    toks = prompt(900, 3)
    want = complete(stack.prefill.url, stack.model, toks)
    tid, p, d = legs(stack)
    before = stack.prefill.stats()
    complete(stack.prefill.url, stack.model, toks, max_tokens=1, kv_transfer_params=p)
    assert writes(stack, tid, 0) == 0  # P holds its blocks, waiting for D
    got = complete(stack.decode.url, stack.model, toks, kv_transfer_params=d)
    assert_same_output(got, want)
    assert writes(stack, tid) == 1
    # Registered after the forward: one whole-request WRITE.
    assert stack.prefill.stats()["layered_writes"] == before["layered_writes"]
    wait_until(lambda: stack.prefill.kv_usage() == 0, 20, "P to free after the WRITE")


def test_unreachable_prefill_recomputes(stack):
    toks = prompt(400, 4)
    want = complete(stack.prefill.url, stack.model, toks)
    _, _, d = legs(stack, port=free_port())
    t0 = time.monotonic()
    got = complete(stack.decode.url, stack.model, toks, kv_transfer_params=d)
    assert_same_output(got, want)
    assert time.monotonic() - t0 < 15


def test_registration_never_matched_recomputes(stack):
    """No P leg ever comes: P's register timeout rejects, D recomputes and frees."""
    toks = prompt(300, 5)
    want = complete(stack.prefill.url, stack.model, toks)
    _, _, d = legs(stack)
    t0 = time.monotonic()
    got = complete(stack.decode.url, stack.model, toks, kv_transfer_params=d)
    assert_same_output(got, want)
    assert time.monotonic() - t0 < EXTRA["push_register_timeout_s"] + 10
    assert stack.decode.kv_usage() == 0


def test_prefill_never_claimed_frees_blocks(stack):
    """P prefilled for a D that never registers: its blocks are freed after the hold timeout."""
    toks = prompt(700, 6)
    _, p, _ = legs(stack)
    complete(stack.prefill.url, stack.model, toks, max_tokens=1, kv_transfer_params=p)
    assert stack.prefill.kv_usage() > 0
    wait_until(lambda: stack.prefill.kv_usage() == 0, EXTRA["push_hold_timeout_s"] + 10,
               "P to free unclaimed blocks")
    assert stack.decode.kv_usage() == 0


def test_push_through_router(stack):
    """The router picks D first and sends both legs at once with one transfer id."""
    import httpx

    for n in (64, 1000):
        toks = prompt(n, 100 + n)
        want = complete(stack.prefill.url, stack.model, toks)
        before = stack.prefill.stats()
        body = {"model": stack.model, "prompt": toks, "max_tokens": 12, "temperature": 0,
                "logprobs": 5, "return_token_ids": True}
        r = httpx.post(stack.router + "/v1/completions", json=body, timeout=120,
                       headers={"x-kvferry-mode": "push"})
        r.raise_for_status()
        assert_same_output(r.json(), want)
        assert settled_writes([stack.prefill], before, 1) == 1
    wait_until(lambda: stack.prefill.kv_usage() == 0, 20, "P to free after the WRITEs")
    assert stack.decode.kv_usage() == 0


def test_push_streams_carry_only_vllms_events(stack):
    """Push streams from real engines (P's first token spliced in front of D's stream):
    every event one vLLM could send, the usage chunk last (helpers_sse)."""
    for usage in (False, True):
        body = {"model": stack.model, "prompt": prompt(300, 41), "max_tokens": 5,
                "temperature": 0, "stream": True,
                **({"stream_options": {"include_usage": True}} if usage else {})}
        r = httpx.post(stack.router + "/v1/completions", json=body, timeout=120,
                       headers={"x-kvferry-mode": "push"})
        assert r.status_code == 200, r.text
        events = strict_events(r.text, chat=False, usage=usage, completion_tokens=5)
        assert len({ev["id"] for ev in events}) == 1


def test_push_stream_first_token_from_prefill(stack):
    """A greedy push stream: P's token 1 goes to the client as soon as P answers, and D's
    own token 1, checked against it by id, is dropped (router/legs/first_token.py): the client
    gets P's own greedy tokens, each once."""
    def first_token(result: str) -> float:
        return metric_at(stack.router, "kvferry_router_first_token_total", result=result)

    before = {r: first_token(r) for r in ("sent", "spliced", "mismatch", "d_first")}
    for n in (64, 1000, 500):
        toks = prompt(n, 300 + n)
        want = complete(stack.prefill.url, stack.model, toks)
        body = {"model": stack.model, "prompt": toks, "max_tokens": 12, "temperature": 0,
                "stream": True, "return_token_ids": True}
        ids: list[int] = []
        text = ""
        with httpx.stream("POST", stack.router + "/v1/completions", json=body, timeout=120,
                          headers={"x-kvferry-mode": "push"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:]).get("choices", []):
                        ids += c.get("token_ids") or []
                        text += c.get("text") or ""
        assert ids == want["choices"][0]["token_ids"] and text == want["choices"][0]["text"]
    got = {r: first_token(r) - before[r] for r in before}
    print("first token from P:", got)
    # Which comes first, P's answer or D's first event, is a race between two processes
    # (P went first in 15 of 16 requests over seven runs here); each stream counts one of the two.
    assert got["sent"] + got["d_first"] == 3 and got["sent"] >= 1
    assert got["spliced"] == got["sent"] and got["mismatch"] == 0


def test_retry_after_cancelled_decode(stack):
    """Attempt 1's D leg is cancelled (client timeout) while it waits for P's WRITE; the
    retry runs under a new transfer id, as the router mints one per attempt. Attempt 1's
    P leg, arriving late, is freed without a WRITE; the retry's output equals colocated."""
    toks = prompt(800, 11)
    want = complete(stack.prefill.url, stack.model, toks)
    tid1, p1, d1 = legs(stack)
    gave_up: dict = {}

    def attempt1() -> None:
        try:
            complete(stack.decode.url, stack.model, toks, kv_transfer_params=d1, timeout=3)
        except httpx.TimeoutException as e:
            gave_up["exc"] = e

    th = threading.Thread(target=attempt1)
    th.start()
    registered(stack, tid1)  # D holds blocks for tid1
    th.join(30)
    assert "exc" in gave_up, "attempt 1 finished before the client gave up"
    # vLLM aborts the D request; D tells P, which rejects the registration at once (not
    # after its register timeout), and D frees the destination blocks.
    s = stack.prefill.when(lambda s: s.find("rejections", tid1),
                           EXTRA["push_register_timeout_s"] - 2, f"P to reject {tid1}")
    assert [e.detail for e in s.find("rejections", tid1)] == ["aborted on P"]
    wait_until(lambda: stack.decode.kv_usage() == 0, 10, "D to free attempt 1's blocks")
    complete(stack.prefill.url, stack.model, toks, max_tokens=1, kv_transfer_params=p1)
    wait_until(lambda: stack.prefill.kv_usage() == 0, 5, "P to free attempt 1's late prefill")
    # The retry, router order: D registers first, P computes.
    tid2, p2, d2 = legs(stack)
    out: dict = {}
    th = run_d(stack, toks, d2, out)
    registered(stack, tid2)
    complete(stack.prefill.url, stack.model, toks, max_tokens=1, kv_transfer_params=p2)
    th.join(60)
    assert_same_output(out["resp"], want)
    assert writes(stack, tid1, 0) == 0 and writes(stack, tid2) == 1
    wait_until(lambda: stack.prefill.kv_usage() == 0, 20, "P to free after the WRITE")
    wait_until(lambda: stack.decode.kv_usage() == 0, 20, "D to free after the answer")


def test_stale_transfer_id_never_gets_old_kv(stack):
    """A D request presenting an old, completed transfer id (another prompt of the same
    length) must not be served the old KV: D knows the id ended and recomputes at once."""
    a, b = prompt(600, 12), prompt(600, 13)
    want_a = complete(stack.prefill.url, stack.model, a)
    want_b = complete(stack.prefill.url, stack.model, b)
    tid, p, d = legs(stack)
    complete(stack.prefill.url, stack.model, a, max_tokens=1, kv_transfer_params=p)
    assert_same_output(complete(stack.decode.url, stack.model, a, kv_transfer_params=d), want_a)
    assert writes(stack, tid) == 1
    wait_until(lambda: stack.prefill.kv_usage() == 0, 20, "P to free after the WRITE")
    before = stack.decode.stats()
    t0 = time.monotonic()
    got = complete(stack.decode.url, stack.model, b, kv_transfer_params=d)
    assert_same_output(got, want_b)
    assert time.monotonic() - t0 < EXTRA["push_register_timeout_s"], "D waited for a WRITE"
    after = stack.decode.stats()  # D counts the failed push before it recomputes
    stale = [e for e in after.since(before) if e.name == "push_failed" and e.key == tid]
    assert [e.detail.startswith("stale transfer id") for e in stale] == [True], stale
    assert after["recomputes"] == before["recomputes"] + 1
    assert writes(stack, tid) == 1, "P wrote an ended transfer again"
    wait_until(lambda: stack.decode.kv_usage() == 0, 10, "D to free the stale request")
    assert stack.prefill.kv_usage() == 0


def test_preempted_push_request_recomputes(stack):
    """D preempts a request whose KV P pushed: it resumes by recomputing (one transfer
    attempt per request), with the same output and every block freed.

    A second D with a 12-block KV cache (plus vLLM's null block) and priority scheduling:
    A (pushed, 7 blocks, low priority) runs; B (local, 5 blocks) fills the cache and needs
    a sixth block 4 tokens in, so vLLM preempts A, the lowest priority.
    """
    logs = stack.prefill.child.log_path.parent
    small = start_engine("decode", stack.model, logs, stack.secret, extra=EXTRA, cpus=(1,),
                         engine_args=("--num-gpu-blocks-override", "13",
                                      "--max-model-len", "1536",
                                      "--scheduling-policy", "priority"))
    try:
        wait_healthy([small.child], STARTUP_S)
        a, b = prompt(770, 14), prompt(636, 15)
        want_a = complete(stack.prefill.url, stack.model, a, max_tokens=100)
        want_b = complete(stack.prefill.url, stack.model, b, max_tokens=40)
        tid, p, d = legs(stack)
        complete(stack.prefill.url, stack.model, a, max_tokens=1, kv_transfer_params=p)
        preempted = small.metric("vllm:num_preemptions_total")
        out: dict = {}

        def run_a() -> None:
            out["a"] = complete(small.url, stack.model, a, max_tokens=100, priority=10,
                                kv_transfer_params=d)

        th = threading.Thread(target=run_a)
        th.start()
        registered(stack, tid)
        writes(stack, tid)  # A's KV landed: A runs
        got_b = complete(small.url, stack.model, b, max_tokens=40, priority=0)
        th.join(120)
        assert small.metric("vllm:num_preemptions_total") > preempted, "nothing was preempted"
        assert_same_output(out["a"], want_a)
        assert_same_output(got_b, want_b)
        assert writes(stack, tid) == 1
        wait_until(lambda: small.kv_usage() == 0, 10, "small D to free every block")
        wait_until(lambda: stack.prefill.kv_usage() == 0, 10, "P to free after the WRITE")
    finally:
        stop_all([small.child])

