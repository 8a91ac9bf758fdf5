"""Real vLLM CPU engines whose kvferry connector moves KV over NIXL's LIBFABRIC backend,
configured as on trn2 (``nixl_backends: ["LIBFABRIC"]``), with libfabric's tcp provider in
place of EFA: pull, push and conversation reuse through the router, each output equal to
a colocated run, every block freed.

The engines inherit LD_LIBRARY_PATH / FI_PROVIDER from tests/libfabric_host.env() (the
vendored libfabric .ci/setup builds, and the CUDA stubs); they keep the nixl wheel.
"""

from __future__ import annotations

import libfabric_host
import pytest
from stack import (
    assert_same_output,
    complete,
    pd_stack,
    prompt,
    settled_writes,
    tiny_model,
    wait_until,
)

from kvferry.connectors.transfer.handshake import fetch

pytestmark = pytest.mark.engine

BS = 128  # CPU engines' block size
EXTRA = {"nixl_backends": ["LIBFABRIC"], "recv_timeout_s": 20, "handshake_timeout_s": 5,
         "send_timeout_s": 30, "push_hold_timeout_s": 20, "push_register_timeout_s": 30,
         "push_recv_timeout_s": 40, "lease_free_grace_s": 2.0, "lease_margin_s": 1.5,
         "reuse_read_timeout_s": 1.0}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if (why := libfabric_host.skip_reason()) is not None:
        pytest.skip(why)
    env = libfabric_host.env()
    mp = pytest.MonkeyPatch()  # engines merge their env over os.environ at launch
    for var in ("LD_LIBRARY_PATH", "FI_PROVIDER"):
        mp.setenv(var, env[var])
    model = tiny_model(tmp_path_factory)
    try:
        # P without prefix caching, as if it had evicted a conversation's history: reuse
        # then READs it back from D (tests/test_e2e_reuse.py does the same over UCX).
        with pd_stack(model, tmp_path_factory.mktemp("logs"), extra=EXTRA,
                      prefill_args=("--no-enable-prefix-caching",),
                      router={"d_local_max_new_tokens": 0}) as s:  # turns via P: reuse READs
            yield s
    finally:
        mp.undo()


def freed(stack) -> None:
    wait_until(lambda: stack.prefill.kv_usage() == 0, 40, "P to free every block")
    wait_until(lambda: stack.decode.kv_usage() == 0, 40, "D to free every block")


def test_engines_run_libfabric_not_ucx(stack):
    """Each engine's agent says, in its handshake, which NIXL backends it created."""
    for e in (stack.prefill, stack.decode):
        hello = fetch("127.0.0.1", e.side_port, e.cfg.handshake_timeout_s)
        assert hello["nixl_backends"] == ["LIBFABRIC"], e.role


def test_pull_through_router_equals_colocated(stack):
    for n in (3, 129, 700, 2100):
        toks = prompt(n, seed=n)
        want = complete(stack.prefill.url, stack.model, toks)
        before, d0 = stack.decode.transferred_tokens(), stack.decode.stats()
        got = complete(stack.router, stack.model, toks)
        assert_same_output(got, want)
        assert stack.decode.transferred_tokens() - before == n, "D must load every prompt token"
        d1 = stack.decode.stats()  # D counts its READ before it schedules the request
        assert (d1["reads_done"] - d0["reads_done"], d1["reads_failed"]) == (1, d0["reads_failed"])
    freed(stack)


def test_push_through_router_equals_colocated(stack):
    import httpx

    for n in (64, 1000):
        toks = prompt(n, 100 + n)
        want = complete(stack.prefill.url, stack.model, toks)
        p0 = stack.prefill.stats()
        body = {"model": stack.model, "prompt": toks, "max_tokens": 12, "temperature": 0,
                "logprobs": 5, "return_token_ids": True}
        r = httpx.post(stack.router + "/v1/completions", json=body, timeout=180,
                       headers={"x-kvferry-mode": "push"})
        r.raise_for_status()
        assert_same_output(r.json(), want)
        assert settled_writes([stack.prefill], p0, 1) == 1
    freed(stack)


def test_conversation_reuse_reads_history_back_from_decode(stack):
    """Each later turn's prompt starts with the previous turn's prompt and output, all of
    it in D's leased blocks: P READs back every full block of it (not its last token)."""
    import httpx

    toks, got_reuse, want_reuse = prompt(300, 1), [], []
    p0 = stack.prefill.stats()
    for i in range(3):
        body = {"model": stack.model, "prompt": toks, "max_tokens": 12, "temperature": 0,
                "logprobs": 5, "return_token_ids": True, "conversation_id": "lf-conv"}
        r = httpx.post(stack.router + "/v1/completions", json=body, timeout=180,
                       headers={"x-kvferry-mode": "pull"})
        r.raise_for_status()
        got = r.json()
        assert_same_output(got, complete(stack.prefill.url, stack.model, toks))
        got_reuse.append(int(r.headers.get("x-kvferry-reused-tokens", 0)))
        out = list(got["choices"][0]["token_ids"])
        held = len(toks) + len(out) - 1  # D's KV: the prompt and all but the last token
        toks = toks + out + prompt(150, 100 + i)
        want_reuse.append(min(held // BS * BS, (len(toks) - 1) // BS * BS))
    assert got_reuse == [0, *want_reuse[:2]] and min(want_reuse[:2]) >= 2 * BS
    p1 = stack.prefill.stats()
    assert p1["reuse_reads_done"] - p0["reuse_reads_done"] == 2, "one READ per later turn"
    assert p1["reuse_reads_failed"] == p0["reuse_reads_failed"]
    # D holds the last turn's blocks under its lease until the conversation ends
    r = httpx.delete(stack.router + "/v1/kvferry/conversations/lf-conv", timeout=30)
    assert r.status_code == 200, r.text
    freed(stack)
