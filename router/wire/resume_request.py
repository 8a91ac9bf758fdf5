"""Continuing a client stream on another engine pair, the request side: whether a stream
can be continued, what reached the client so far (`Progress`), the continuation request,
and the end of a stream nothing was left to generate for. No I/O (`router/legs/migrate.py`
runs it; `resume.EventRewriter` records `Progress` from D's events).

Token ids, never text: D's leg asks `return_token_ids`, so every event says which tokens
it carries (`Progress.sent`); the continuation is a `/v1/completions` request whose
`prompt` is the prompt's token ids (for chat, the rendered prompt D reported in its first
event) followed by the tokens already sent, with `max_tokens` (and `min_tokens`) reduced
by their number. Re-tokenizing the text sent so far could give other ids (a word split
across chunks, a byte-level merge); the ids cannot. Greedy decoding then continues with
the tokens an uninterrupted run would have produced: the continuation's D decodes from
the KV of exactly that sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from . import bodies

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""vLLM's `max_tokens` when a completions request names none."""

STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex",
              "guided_choice", "guided_grammar")
"""Constrained decoding restarts its grammar with the continuation: refused."""

CHAT_SAMPLING = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                 "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "logit_bias", "bad_words", "allowed_token_ids",
                 "skip_special_tokens", "spaces_between_special_tokens",
                 "include_stop_str_in_output", "user", "priority", "stream_options")
"""What of a chat request its completions continuation carries (the rest is rendering:
messages, template, tools, none of which applies to a prompt of token ids)."""

COMPLETIONS_DROP = ("prompt", "echo", "suffix", "max_tokens", "min_tokens", "prompt_logprobs")


def unsupported(endpoint: str, clean: dict[str, Any]) -> str | None:
    """Why this request's stream cannot be continued token-exactly elsewhere, or None."""
    if not bodies.wants_stream(clean):
        return "not a stream"
    for key in ("n", "best_of"):
        if clean.get(key) not in (None, 1):
            return f"{key} > 1"
    for key in STRUCTURED:
        if clean.get(key):
            return key
    if clean.get("stop"):
        # D holds text back while it may be the start of a stop string, yet reports the
        # tokens: text of tokens already sent could never reach the client.
        return "stop strings"
    if endpoint == bodies.CHAT:
        if clean.get("tools"):
            return "tools"
        if clean.get("logprobs") or clean.get("top_logprobs"):
            return "chat logprobs"
        return None
    prompt = clean.get("prompt")
    if not (isinstance(prompt, str) or bodies.token_ids(prompt) is not None):
        return "several prompts"
    if clean.get("echo"):
        return "echo"
    return None


@dataclass
class Progress:
    """What reached the client of one stream, over every engine that served it."""

    endpoint: str
    want_ids: bool
    """The client asked for token ids itself (else D's are nulled on the way)."""
    prompt_ids: list[int] | None = None
    sent: list[int] = field(default_factory=list)
    id: str | None = None
    created: int | None = None
    model: str | None = None
    events: int = 0
    finished: bool = False
    role_sent: bool = False
    text_chars: int = 0


def continuation_body(progress: Progress, clean: dict[str, Any]) -> dict[str, Any] | None:
    """The `/v1/completions` request that continues the stream, or None when no token is
    left to generate. Needs `progress.prompt_ids`."""
    assert progress.prompt_ids is not None
    k = len(progress.sent)
    if progress.endpoint == bodies.CHAT:
        body = {key: clean[key] for key in CHAT_SAMPLING if key in clean}
        limit = clean.get("max_completion_tokens", clean.get("max_tokens"))
    else:
        body = {key: v for key, v in clean.items() if key not in COMPLETIONS_DROP}
        limit = clean.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)
    if isinstance(limit, int):
        if limit - k <= 0:
            return None
        body["max_tokens"] = limit - k
    else:  # None: up to the model's length, the same bound for prompt + k
        body["max_tokens"] = None
    if isinstance(min_tokens := clean.get("min_tokens"), int) and min_tokens - k > 0:
        body["min_tokens"] = min_tokens - k
    body.update(prompt=[*progress.prompt_ids, *progress.sent], stream=True,
                return_token_ids=True)
    return body


def closing_events(progress: Progress, clean: dict[str, Any], finish: str | None) -> bytes:
    """The end of a stream whose engine broke when nothing was left to generate: a
    finishing chunk (when the last one never came), usage if the client asked, [DONE]."""
    p = progress
    head = {"id": p.id, "created": p.created, "model": p.model,
            "object": "chat.completion.chunk" if p.endpoint == bodies.CHAT else "text_completion"}
    events = []
    if finish is not None:
        choice: dict[str, Any] = ({"index": 0, "delta": {"content": ""}, "logprobs": None,
                                   "finish_reason": finish} if p.endpoint == bodies.CHAT else
                                  {"index": 0, "text": "", "logprobs": None,
                                   "finish_reason": finish})
        events.append({**head, "choices": [choice]})
    options = clean.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        prompt = len(p.prompt_ids or [])
        events.append({**head, "choices": [], "usage": {
            "prompt_tokens": prompt, "completion_tokens": len(p.sent),
            "total_tokens": prompt + len(p.sent)}})
    return b"".join(b"data: " + msgspec.json.encode(e) + b"\n\n" for e in events) + \
        b"data: [DONE]\n\n"
