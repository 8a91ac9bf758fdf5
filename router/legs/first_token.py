"""First token from P (push, greedy streams): the client gets the token P sampled as soon
as P answers, instead of after D's first step.

In push mode D's request leaves with P's, before P has sampled, and vLLM has no API to
append a token to a queued request (README, "Push mode"), so D still computes the
prompt's last position and samples token 1 itself. The router sends P's token 1 at once,
in D's event format, then checks D's own token 1 against it by id and drops it from D's
stream (`resume.EventRewriter.splice`). Only greedy requests are spliced: with sampling
the two engines would draw different tokens. A D whose token 1 differs all the same (a
floating-point near-tie between P's prefill kernels and D's decode step) has its leg
ended, and the stream goes on from prompt + P's token on a pull pair (migrate.py), so the
client never gets a token that does not follow the ones before it.

Both legs must report token ids (`return_token_ids`), so only streams migration could
continue are spliced (`resume_request.unsupported`: no tools, stop strings, n > 1, ...). Chat
only with `first_token_chat`: the router cannot see whether the engines run a reasoning
parser, which may render one token differently in P's whole answer and in D's stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from ..settings import RouterSettings
from ..wire import bodies

REASONING = ("reasoning", "reasoning_content")


def why_not(endpoint: str, clean: dict[str, Any], migration_why_not: str | None,
            settings: RouterSettings) -> str | None:
    """Why this push request's first token does not come from P, or None."""
    if not settings.first_token_from_prefill:
        return "off"
    if migration_why_not:
        return migration_why_not
    if endpoint == bodies.CHAT and not settings.first_token_chat:
        return "chat"
    if clean.get("temperature") != 0:  # absent: the model's default, maybe sampling
        return "sampling"
    if clean.get("logprobs") or clean.get("top_logprobs") or clean.get("echo"):
        return "logprobs"
    limit = clean.get("max_completion_tokens", clean.get("max_tokens"))
    if isinstance(limit, int) and limit < 1:
        return "max_tokens"
    return None


@dataclass(frozen=True)
class PToken:
    """Token 1 as P's answer gave it."""

    token_id: int
    text: str
    prompt_ids: list[int] | None
    id: Any = None
    created: Any = None
    model: Any = None


def from_answer(endpoint: str, obj: Any) -> PToken | None:
    """P's token 1 from its JSON answer (asked with `return_token_ids`), or None when the
    answer carries no single plain token (a chat answer with reasoning or tool calls)."""
    if not isinstance(obj, dict):
        return None
    choices = obj.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    ids = choice.get("token_ids")
    if not (isinstance(ids, list) and len(ids) == 1 and type(ids[0]) is int):
        return None
    if endpoint == bodies.CHAT:
        msg = choice.get("message")
        if not isinstance(msg, dict) or msg.get("tool_calls") or any(msg.get(k) for k in REASONING):
            return None
        text, prompt = msg.get("content"), obj.get("prompt_token_ids")
    else:
        text, prompt = choice.get("text"), choice.get("prompt_token_ids")
    if not isinstance(text, str):
        return None
    prompt_ids = prompt if isinstance(prompt, list) and all(type(t) is int for t in prompt) else None
    return PToken(ids[0], text, prompt_ids, obj.get("id"), obj.get("created"), obj.get("model"))


def event(endpoint: str, tok: PToken) -> bytes:
    """P's token 1 as D's first event would carry it (token ids included: the stream's
    rewriter records them and nulls them unless the client asked)."""
    head = {"id": tok.id, "created": tok.created, "model": tok.model}
    if endpoint == bodies.CHAT:
        obj = {**head, "object": "chat.completion.chunk", "choices": [{
            "index": 0, "delta": {"role": "assistant", "content": tok.text}, "logprobs": None,
            "finish_reason": None, "token_ids": [tok.token_id]}],
            "prompt_token_ids": tok.prompt_ids}
    else:
        obj = {**head, "object": "text_completion", "choices": [{
            "index": 0, "text": tok.text, "logprobs": None, "finish_reason": None,
            "stop_reason": None, "prompt_token_ids": tok.prompt_ids,
            "token_ids": [tok.token_id]}]}
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class Head:
    """P's token 1 for one client stream (`sse.UpstreamStream` sends it unless D's first
    event came first). ``answer``: awaits P's parsed answer (None: no usable answer);
    ``splice``: arms the stream's rewriter with the token sent; ``count``: the outcome
    counter; ``on_sent``: the token went to the client (timeline, TTFT)."""

    def __init__(self, endpoint: str, answer: Callable[[], Any],
                 splice: Callable[[PToken], None], count: Callable[[str], None],
                 on_sent: Callable[[], None]) -> None:
        self.endpoint = endpoint
        self._answer = answer
        self._splice = splice
        self._count = count
        self._on_sent = on_sent
        self.token: PToken | None = None
        self.sent_at: float | None = None  # perf_counter when it went to the client
        self.outcome: str | None = None  # sent, d_first or no_token: the first one counts

    def _end(self, outcome: str) -> None:
        if self.outcome is None:
            self.outcome = outcome
            self._count(outcome)

    async def ready(self) -> bytes | None:
        """P's token 1 event once P answered, or None."""
        try:
            obj = await self._answer()
        except asyncio.CancelledError:
            raise
        except Exception:  # P's leg failed: D's stream as is
            obj = None
        self.token = from_answer(self.endpoint, obj) if obj is not None else None
        if self.token is None:
            self._end("no_token")
            return None
        return event(self.endpoint, self.token)

    def sent(self) -> None:
        """The event went through the leg's filter to the client: drop D's token 1."""
        assert self.token is not None
        self.sent_at = time.perf_counter()
        self._splice(self.token)
        self._end("sent")
        self._on_sent()

    def lost(self) -> None:
        """D's first chunk went first (P's answer may still come; it is not used)."""
        self._end("d_first")
