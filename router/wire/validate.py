"""What a decode engine would refuse, checked before any prefill work.

P sees the client's prompt with max_tokens=1 and without the decode-only fields
(`bodies.PREFILL_DROP`), so a request D refuses (max_tokens 0, n < 1, ...) would be
prefilled on P first, and P would keep its blocks for an offer nobody reads. These are
vLLM's own rules for exactly those fields (the router imports no vLLM), per version where
they differ:

- integers as vLLM's pydantic request models take them (lax: 2.0 and "2" are 2, 2.5 is
  refused);
- `SamplingParams._verify_args`: max_tokens >= 1, 1 <= n <= VLLM_MAX_N_SEQUENCES (16384),
  0 <= min_tokens <= max_tokens, logprobs and prompt_logprobs >= -1 (-1: all);
- the request models' check: stream_options only with stream=true;
- prompt + max_tokens beyond max_model_len: refused by vLLM up to 0.26
  (`renderers/params.py`: max_input_tokens = max_model_len - max_output_tokens), clamped
  from 0.32 on (`get_max_tokens`), so refused here only for engines that refuse it.
  Token-id prompts are checked before P; for text prompts the router learns the length
  from P's answer (`over_length`), and then frees P's offer itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from . import bodies

MAX_N = 16384
"""vLLM's VLLM_MAX_N_SEQUENCES default."""
REFUSES_BELOW = (0, 27)
"""vLLM versions below this refuse prompt + max_tokens beyond max_model_len (0.21, 0.24 and
0.26 were read); 0.32 and 0.33 clamp; those between are not known either way and are not
refused here (a D refusal still frees P's blocks at once)."""

_INT = TypeAdapter(int | None)


@dataclass(frozen=True)
class EngineLimits:
    """What the decode engines said of themselves (/v1/models, /version)."""

    max_model_len: int | None = None
    version: tuple[int, int] | None = None

    @property
    def refuses_over_length(self) -> bool:
        return self.version is not None and self.version < REFUSES_BELOW


def _int(body: dict[str, Any], name: str) -> int | None:
    """The field as vLLM reads it; ValueError with vLLM-like words when it cannot."""
    try:
        return _INT.validate_python(body.get(name))
    except ValidationError:
        raise ValueError(f"{name} must be an integer, got {body.get(name)!r}") from None


def max_tokens_of(endpoint: str, body: dict[str, Any]) -> int | None:
    """The output budget the client asked for (chat: max_completion_tokens wins)."""
    if endpoint == bodies.CHAT:
        mct = _int(body, "max_completion_tokens")
        if mct is not None:
            return mct
    return _int(body, "max_tokens")


def refusal(endpoint: str, body: dict[str, Any], limits: EngineLimits) -> str | None:
    """Why D would refuse ``body`` (a client-facing message), or None."""
    try:
        max_tokens = max_tokens_of(endpoint, body)
        if max_tokens is not None and max_tokens < 1:
            return f"max_tokens must be at least 1, got {max_tokens}."
        n = _int(body, "n")
        if n is not None and not 1 <= n <= MAX_N:
            return f"n must be at least 1 and at most {MAX_N}, got {n}."
        min_tokens = _int(body, "min_tokens")
        if min_tokens is not None and min_tokens < 0:
            return f"min_tokens must be greater than or equal to 0, got {min_tokens}."
        if min_tokens is not None and max_tokens is not None and min_tokens > max_tokens:
            return (f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                    f"got {min_tokens}.")
        names = ("prompt_logprobs",) if endpoint == bodies.CHAT else ("logprobs",
                                                                      "prompt_logprobs")
        for name in names:
            v = _int(body, name)
            if v is not None and v < -1:
                return f"{name} must be non-negative or -1, got {v}."
    except ValueError as e:
        return str(e)
    if body.get("stream_options") is not None and not body.get("stream"):
        return "Stream options can only be defined when `stream=True`."
    ids = bodies.token_ids(body.get("prompt")) if endpoint == bodies.COMPLETIONS else None
    if ids is not None:
        return over_length(len(ids), max_tokens, limits)
    return None


def over_length(prompt_tokens: int, max_tokens: int | None, limits: EngineLimits) -> str | None:
    """vLLM's words when D would refuse a prompt this long with this budget (engines that
    refuse rather than clamp), else None."""
    if not limits.refuses_over_length or limits.max_model_len is None or max_tokens is None:
        return None
    if prompt_tokens + max_tokens <= limits.max_model_len:
        return None
    return (f"This model's maximum context length is {limits.max_model_len} tokens. "
            f"However, you requested {max_tokens} output tokens and your prompt contains "
            f"{prompt_tokens} input tokens, for a total of {prompt_tokens + max_tokens} "
            "tokens. Please reduce the length of the input prompt or the number of "
            "requested output tokens.")
