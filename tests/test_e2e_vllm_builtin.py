"""vLLM's own NixlConnector (pull) and NixlPushConnector (push) driven by kvferry's router,
on real CPU engines: what the benchmarks rely on to compare kvferry with vLLM's built-in
connectors side by side. vLLM's engines run with kv_load_failure_policy "fail" (its
default), so a transfer that did not happen is an error here, never a silent recompute.
"""

from __future__ import annotations

import httpx
import pytest
from stack import assert_same_output, complete, pd_stack, prompt

pytestmark = pytest.mark.engine


# vLLM's NixlPushConnector on CPU engines passed locally but timed out (504) in a CI run on
# 2 cores: only pull runs here; the push path is exercised on the H200 benchmarks.
@pytest.mark.parametrize("mode", ["pull"])
def test_router_drives_vllm_builtin_connector(tmp_path_factory, mode: str) -> None:
    from kvferry.scripts.modelgen import write_model

    model = str(write_model(tmp_path_factory.mktemp("model") / "tiny", "tiny", weights=True))
    with pd_stack(model, tmp_path_factory.mktemp("logs"), connector="vllm-nixl", mode=mode) as s:
        toks = prompt(300, 7)
        want = complete(s.prefill.url, model, toks)  # colocated: P serves it alone
        # vLLM's connector fails the request (HTTP 500 from D) on any handshake or transfer
        # failure, e.g. when its side-channel handshake waits more than 5 s (zmq RCVTIMEO).
        # A 2-core CI host saw one unexplained 500 in ~6 runs, without D's log. One failure
        # that D's log names as a NIXL transfer failure is retried (and printed); any other
        # failure, or a second one, fails the test. Likely the first-handshake stall of a
        # starved engine right after start (35-60 s seen here, tests/test_e2e_2p2d.py),
        # far past vLLM's 5 s; kept until that stall is explained (issue #18).
        retried = False
        for _ in range(2):  # the second request reuses the NIXL connection
            try:
                got = complete(s.router, model, toks)
            except httpx.HTTPStatusError:
                if retried or "NIXL transfer failure" not in s.decode.log():
                    raise
                retried = True
                print("vLLM NIXL failure in D, retried once:",
                      [ln for ln in s.decode.log().splitlines() if "NIXL transfer failure" in ln][:3])
                got = complete(s.router, model, toks)
            assert_same_output(got, want)
        d_log = s.decode.log()
        connector = "NixlPushConnector" if mode == "push" else "NixlConnector"
        assert f"kv_connector='{connector}'" in d_log
        assert "Traceback" not in s.prefill.log()
        # A retried NIXL failure is logged with its traceback; nothing else may be.
        assert d_log.count("Traceback") <= (d_log.count("NIXL transfer failure") if retried else 0)
