"""router/wire/validate.py's rules against vLLM's own, in the venv's vLLM (the version CI's
engines run): for every body below, the router refuses it before any prefill exactly when
vLLM's request models, `get_max_tokens` and `SamplingParams` (the path of its serving code)
refuse it. A rule the router gets wrong either way shows here: a refusal vLLM would not
make turns a good request away, a missed one lets P prefill for a D that will refuse."""

from __future__ import annotations

import itertools
import json
from typing import Any

from kvferry.router.wire import bodies
from kvferry.router.wire.validate import EngineLimits, refusal

MAX_MODEL_LEN = 4096
PROMPT_LEN = 8  # the prompt below: token ids, so both sides know its length

FIELDS: dict[str, list[Any]] = {
    "max_tokens": [None, -5, 0, 1, 2.0, "2", 1.5, "many", 10**9],
    "n": [None, -1, 0, 1, 2, 16384, 20000],
    "min_tokens": [None, -1, 0, 1, 5],
    "logprobs": [None, -3, -1, 0, 2],
    "prompt_logprobs": [None, -2, -1, 0, 1],
}
STREAMS: list[dict[str, Any]] = [{}, {"stream": True}, {"stream_options": {"include_usage": True}},
                                 {"stream": True, "stream_options": {"include_usage": True}}]


def vllm_refuses(endpoint: str, body: dict[str, Any]) -> bool:
    """What vLLM 0.32's OpenAI server does with ``body`` before it schedules anything
    (completion/serving.py and chat_completion/serving.py: request model, then
    get_max_tokens, then to_sampling_params, whose SamplingParams checks its arguments)."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
    from vllm.exceptions import VLLMValidationError

    model = ChatCompletionRequest if endpoint == bodies.CHAT else CompletionRequest
    try:
        req = model(**body)
        budget = req.max_tokens  # chat: max_completion_tokens wins when set (serving.py)
        if endpoint == bodies.CHAT and req.max_completion_tokens is not None:
            budget = req.max_completion_tokens
        max_tokens = get_max_tokens(MAX_MODEL_LEN, budget, PROMPT_LEN, {})
        req.to_sampling_params(max_tokens, {})
    except (ValidationError, VLLMValidationError, ValueError, TypeError):
        return True
    return False


def cases() -> list[tuple[str, dict[str, Any]]]:
    """Each field alone at every value, max_tokens x min_tokens, the stream options, and
    chat's max_completion_tokens beside max_tokens; None means "not sent"."""
    out: dict[str, tuple[str, dict[str, Any]]] = {}  # by JSON text: each body once

    def add(endpoint: str, body: dict[str, Any]) -> None:
        body = {k: v for k, v in body.items() if v is not None}
        out.setdefault(endpoint + json.dumps(body, sort_keys=True), (endpoint, body))

    for endpoint in (bodies.COMPLETIONS, bodies.CHAT):
        base: dict[str, Any] = ({"model": "m", "prompt": list(range(PROMPT_LEN))}
                                if endpoint == bodies.COMPLETIONS else
                                {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        for name, values in FIELDS.items():
            if endpoint == bodies.CHAT and name == "logprobs":
                continue  # chat's logprobs is a bool (top_logprobs is the count)
            for v in values:
                add(endpoint, {**base, name: v})
        for mt, mn in itertools.product(FIELDS["max_tokens"][:6], FIELDS["min_tokens"]):
            add(endpoint, {**base, "max_tokens": mt, "min_tokens": mn})
        for s in STREAMS:
            add(endpoint, {**base, **s})
        if endpoint == bodies.CHAT:
            for v in (0, 1, -2):
                add(endpoint, {**base, "max_completion_tokens": v, "max_tokens": 5})
    return list(out.values())


def test_the_router_refuses_exactly_what_vllm_refuses() -> None:
    limits = EngineLimits(max_model_len=MAX_MODEL_LEN, version=(0, 32))
    checked = cases()
    disagree = [(e, b, refusal(e, b, limits)) for e, b in checked
                if (refusal(e, b, limits) is not None) != vllm_refuses(e, b)]
    assert not disagree, disagree
    refused = sum(vllm_refuses(e, b) for e, b in checked)
    assert len(checked) > 80 and 20 < refused < len(checked) - 20  # both kinds are covered
