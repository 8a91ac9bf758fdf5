"""GPU end to end (H200 x2): two vLLM 0.26.0 CUDA engines, one per GPU, kvferry pull over
NIXL/UCX (cuda_ipc over NVLink). Run on the device machine with the gpukit:

    KVFERRY_GPU=1 python -m pytest -q tests/gpu

A qwen3-8b-shaped model with vLLM's dummy weights (no hub here); greedy outputs through
P/D must equal the prefill engine serving the same request alone.
"""

from __future__ import annotations

import os
import random

import pytest
from stack import assert_same_output, complete, pd_stack

from kvferry.scripts.modelgen import write_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    os.environ.get("KVFERRY_GPU") != "1", reason="GPU suite: set KVFERRY_GPU=1 on the H200 machine")]

LENGTHS = (5, 1000, 4000, 16000)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model = str(write_model(tmp_path_factory.mktemp("model") / "qwen3-8b", "qwen3-8b"))
    args = ("--max-model-len", "20000", "--gpu-memory-utilization", "0.85")
    with pd_stack(model, tmp_path_factory.mktemp("logs"), backend="cuda", engine_args=args) as s:
        yield s


def test_gpu_pd_equals_colocated(stack):
    rnd = random.Random(0)
    for n in LENGTHS:
        toks = [rnd.randrange(10, 150000) for _ in range(n)]
        want = complete(stack.prefill.url, stack.model, toks, max_tokens=16)
        reads = stack.decode.reads()
        got = complete(stack.router, stack.model, toks, max_tokens=16)
        assert_same_output(got, want)
        assert stack.decode.reads() == reads + 1, "D must have READ the prompt's KV from P"
    print(stack.decode.reads(), "READs;",
          [line for line in stack.decode.log().splitlines() if "kvferry READ" in line][-len(LENGTHS):])
