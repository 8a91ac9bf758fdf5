"""Push end to end on real vLLM CPU engines: D registers its blocks while P computes, P
WRITEs them from its transfer thread. Both orders of {registration, prefill done} are
forced deterministically; failures end in a local recompute with blocks freed.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from stack import assert_same_output, complete, free_port, prompt, tiny_stack, wait_until

pytestmark = pytest.mark.engine

EXTRA = {"push_hold_timeout_s": 8, "push_register_timeout_s": 8, "push_recv_timeout_s": 20,
         "push_quarantine_s": 1, "handshake_timeout_s": 3}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with tiny_stack(tmp_path_factory, EXTRA) as s:
        yield s


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


def wait_log(engine, needle: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while needle not in engine.log():
        assert time.monotonic() < deadline, f"{engine.role} never logged {needle!r}"
        time.sleep(0.1)



def writes(stack, tid: str) -> int:
    return stack.prefill.log_count(f"kvferry WRITE {tid}")


@pytest.mark.parametrize("n", [200, 1500])
def test_registration_first(stack, n):
    toks = prompt(n, n)
    want = complete(stack.prefill.url, stack.model, toks)
    tid, p, d = legs(stack)
    reads = stack.decode.reads()
    out: dict = {}
    th = run_d(stack, toks, d, out)
    wait_log(stack.prefill, f"push {tid}: registration")  # D registered before P computed
    complete(stack.prefill.url, stack.model, toks, max_tokens=1, kv_transfer_params=p)
    th.join(60)
    assert_same_output(out["resp"], want)
    assert writes(stack, tid) == 1
    assert stack.decode.reads() == reads, "push must not fall back to pull"
    # Pull of the same prompt loads the same KV: D's outputs must agree to the bit.
    pulled = complete(stack.router, stack.model, toks)
    assert_same_output(out["resp"], pulled, first=4, tol=0.0)


def test_prefill_first(stack):
    toks = prompt(900, 3)
    want = complete(stack.prefill.url, stack.model, toks)
    tid, p, d = legs(stack)
    complete(stack.prefill.url, stack.model, toks, max_tokens=1, kv_transfer_params=p)
    assert writes(stack, tid) == 0  # P holds its blocks, waiting for D
    got = complete(stack.decode.url, stack.model, toks, kv_transfer_params=d)
    assert_same_output(got, want)
    assert writes(stack, tid) == 1
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
        writes_before = stack.prefill.log_count("kvferry WRITE ")
        body = {"model": stack.model, "prompt": toks, "max_tokens": 12, "temperature": 0,
                "logprobs": 5, "return_token_ids": True}
        r = httpx.post(stack.router + "/v1/completions", json=body, timeout=120,
                       headers={"x-kvferry-mode": "push"})
        r.raise_for_status()
        assert_same_output(r.json(), want)
        assert stack.prefill.log_count("kvferry WRITE ") == writes_before + 1
    wait_until(lambda: stack.prefill.kv_usage() == 0, 20, "P to free after the WRITEs")
    assert stack.decode.kv_usage() == 0
