"""What the TP end-to-end tests share (tests/test_e2e_tp.py on CPU, tests/gpu/test_gpu_tp.py):
the logprob tolerance for KV computed with another TP size, and a routed completion that
returns the router's headers too."""

from __future__ import annotations

import httpx

# P computes the KV with another TP size than D's reference: its all-reduce sums in another
# order, so bf16 KV values move by an ulp and first-token logprobs by up to 0.18 (seen).
TP_TOL = 0.3


def routed(router: str, model: str, toks: list[int], mode: str, cid: str | None = None
           ) -> tuple[dict, httpx.Headers]:
    body = {"model": model, "prompt": toks, "max_tokens": 12, "temperature": 0,
            "logprobs": 5, "return_token_ids": True}
    if cid:
        body["conversation_id"] = cid
    r = httpx.post(router + "/v1/completions", json=body, timeout=300,
                   headers={"x-kvferry-mode": mode})
    r.raise_for_status()
    return r.json(), r.headers
