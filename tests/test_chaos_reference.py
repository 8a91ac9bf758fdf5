"""The chaos run's references (scripts/chaos_traffic.reference): asked once of the first
prefill engine, never retried; a failure stops the run with the engine's status and body.
The engines here are FAKES (httpx.MockTransport handlers): what is checked is only the
reference's policy; the chaos test itself runs it against real engines."""

from __future__ import annotations

import httpx
import pytest

from kvferry.scripts import chaos_traffic
from kvferry.scripts.chaos_traffic import Item, NoReference, completion, reference

ENGINES = ["http://p0:8100", "http://p1:8100"]


def fake_engines(status: list[int]) -> tuple[httpx.Client, list[str]]:
    """A client whose engines answer the given statuses in turn (FAKE: no vLLM)."""
    seen: list[str] = []

    def handle(req: httpx.Request) -> httpx.Response:
        seen.append(f"{req.url.host}:{req.url.port}")
        code = status[min(len(seen), len(status)) - 1]
        if code != 200:
            return httpx.Response(code, json={"error": {"message": "fake refusal"}})
        return httpx.Response(200, json={"choices": [{
            "text": " ok", "token_ids": [7, 8],
            "logprobs": {"top_logprobs": [{" ok": -0.1}]}}]})

    return httpx.Client(transport=httpx.MockTransport(handle)), seen


def test_a_reference_is_one_request_to_the_first_prefill() -> None:
    client, seen = fake_engines([200])
    want = reference(ENGINES, Item("completions", completion("m", [1, 2], 2, True)), client)
    assert want == chaos_traffic.answer("completions", {"choices": [{
        "text": " ok", "token_ids": [7, 8], "logprobs": {"top_logprobs": [{" ok": -0.1}]}}]})
    assert seen == ["p0:8100"]


@pytest.mark.parametrize("code", [503, 400, 500])
def test_a_failed_reference_is_not_retried_and_names_the_answer(code: int) -> None:
    client, seen = fake_engines([code, 200])
    with pytest.raises(NoReference) as exc:
        reference(ENGINES, Item("completions", completion("m", [1, 2], 2, False)), client)
    assert seen == ["p0:8100"]  # not asked again, nor of another engine
    assert exc.value.status == code
