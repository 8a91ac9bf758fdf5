"""vLLM's own NixlConnector (pull) and NixlPushConnector (push) driven by kvferry's router,
on real CPU engines: what the benchmarks rely on to compare kvferry with vLLM's built-in
connectors side by side. vLLM's engines run with kv_load_failure_policy "fail" (its
default), so a transfer that did not happen is an error here, never a silent recompute.
"""

from __future__ import annotations

import os
import time

import pytest
from stack import assert_same_output, complete, pd_stack, prompt, tiny_model

from kvferry.scripts.cpu_pin import workers

pytestmark = pytest.mark.engine

FAILED = "vllm:nixl_num_failed_transfers_total"  # handshake, transfer and notification failures


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_router_drives_vllm_builtin_connector(tmp_path_factory, mode: str) -> None:
    model = tiny_model(tmp_path_factory)
    with pd_stack(model, tmp_path_factory.mktemp("logs"), connector="vllm-nixl", mode=mode) as s:
        # vLLM's NIXL worker moves its forward onto the host's last core (scripts/cpu_pin.py):
        # both engines computed on one core, and a first request took 35-60 s, long enough
        # for D's 5 s handshake to P to fail now and then. The stack put them back.
        p_cores, d_cores = ([os.sched_getaffinity(pid) for pid in workers(e.child)]
                            for e in (s.prefill, s.decode))
        assert len(p_cores) == len(d_cores) == 1  # one TP rank each
        assert p_cores[0].isdisjoint(d_cores[0]), f"P on {p_cores}, D on {d_cores}"
        assert s.prefill.rebound or s.decode.rebound, "vLLM no longer moves its worker"
        toks = prompt(300, 7)
        want = complete(s.prefill.url, model, toks)  # colocated: P serves it alone
        failed0 = s.prefill.metric(FAILED) + s.decode.metric(FAILED)
        t0 = time.monotonic()
        for i in range(2):  # the second request reuses the NIXL connection
            # vLLM's connector fails the request (HTTP 500 from D) on any handshake or
            # transfer failure: none is expected.
            got = complete(s.router, model, toks)
            # Printed with a failure (pytest shows captured output): P's KV expires unread
            # after vLLM's kv_lease_duration (30 s) unless D read it or sent heartbeats.
            print(f"request {i} done at +{time.monotonic() - t0:.1f}s")
            assert_same_output(got, want)
        # vLLM's own connector moved the KV (kvferry's exports no vllm:nixl_* metrics):
        # D READs in pull, P WRITEs in push ...
        mover = s.prefill if mode == "push" else s.decode
        assert mover.metric("vllm:nixl_xfer_time_seconds_count") >= 1
        # ... nothing failed; P's KV never expired unread.
        assert s.prefill.metric(FAILED) + s.decode.metric(FAILED) == failed0
        assert s.prefill.metric("vllm:nixl_num_kv_expired_reqs_total") == 0
        for e in (s.prefill, s.decode):
            assert e.child.alive(), f"{e.role} died"
