"""GPU, different TP sizes (needs 3+ GPUs, e.g. nvidia-h200-x4): P with TP 2 on GPUs 0-1,
D with TP 1 on GPU 2, vLLM 0.26.0 CUDA engines, kvferry pull and push through the router.

    KVFERRY_GPU=1 python -m pytest -q tests/gpu/test_gpu_tp.py

qwen3-0.6b-shaped (8 KV heads: 4 per P rank), dummy weights. Checks: outputs equal D
serving alone (first-token logprobs within helpers_tp.TP_TOL: TP 2's all-reduce rounds
differently), push equals pull to the bit, every P rank WRITEs, the heads were located in
the cross-layer blocks (0.26's backend probe). Not run yet: no 3-GPU kind was lent.
With vLLM's default NHD layout a head segment is one descriptor per (layer, token) of a
block, so inputs stay short here; HND (VLLM_KV_CACHE_LAYOUT=HND) makes it one per layer.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import subprocess
from contextlib import ExitStack

import pytest
from helpers_tp import TP_TOL, routed
from stack import (
    STARTUP_S,
    assert_same_output,
    complete,
    serve_kvferry_router,
    settled_writes,
    start_engine,
)

from kvferry.connectors.memory.backends import KVLayout
from kvferry.connectors.transfer.handshake import fetch
from kvferry.scripts.modelgen import write_model
from kvferry.scripts.procs import stop_all, wait_healthy


def _gpus() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    os.environ.get("KVFERRY_GPU") != "1" or _gpus() < 3,
    reason="GPU TP suite: set KVFERRY_GPU=1 on a machine with 3+ GPUs")]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model = str(write_model(tmp_path_factory.mktemp("model") / "qwen3-0.6b", "qwen3-0.6b"))
    logs = tmp_path_factory.mktemp("logs")
    secret = secrets.token_hex(16)
    args = ("--max-model-len", "20000", "--gpu-memory-utilization", "0.85",
            "--no-enable-prefix-caching")
    with ExitStack() as es:
        p = start_engine("prefill", model, logs, secret, backend="cuda", engine_args=args,
                         tp=2, devices=(0, 1))
        d = start_engine("decode", model, logs, secret, backend="cuda", engine_args=args,
                         devices=(2,))
        es.callback(stop_all, [p.child, d.child])
        wait_healthy([p.child, d.child], STARTUP_S)
        yield p, d, serve_kvferry_router(es, [p], [d], secret), model


@pytest.mark.parametrize("n", [1000, 4000])
def test_tp2_prefill_tp1_decode_pull_and_push(stack, n):
    p, d, router, model = stack
    toks = [random.Random(n).randrange(10, 150000) for _ in range(n)]
    want = complete(d.url, model, toks, max_tokens=16)
    pulled, _ = routed(router, model, toks, "pull")
    p0 = p.stats()
    pushed, _ = routed(router, model, toks, "push")
    assert_same_output(pulled, want, tol=TP_TOL)
    assert_same_output(pushed, pulled, tol=0)
    assert settled_writes([p], p0, 2) == 2
    s = d.stats()
    assert s["reads_failed"] == s["recomputes"] == 0, s.events[-5:]
    info = fetch("127.0.0.1", d.side_port, d.cfg.handshake_timeout_s)
    assert KVLayout.from_wire(info["layout"]).num_heads == 8  # D located its 8 KV heads
