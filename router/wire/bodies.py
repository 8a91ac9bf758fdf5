"""Pure request-body transforms for the two legs (no I/O, unit-testable).

Fields in ROUTER_FIELDS belong to the router: a client may send them to steer the router,
but they never reach an engine. In particular a client can never choose which remote
blocks an engine reads, because `kv_transfer_params` is always removed and only the
router sets it.

Copies are shallow: the legs share the client's nested values (a 16k-token prompt list),
which nothing here or downstream mutates; only top-level keys are set. Deep-copying such
a prompt three times cost ~20 ms of router CPU per request, all on the TTFT path.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvferry.connectors.protocol import params as kv

ROUTER_FIELDS = ("kv_transfer_params", "kvferry_mode", "conversation_id", "session_id")
"""Body fields the router consumes and never forwards."""

ENGINE_FIELDS = ("kv_transfer_params", "ec_transfer_params")
"""Answer fields that are engine-internal (block ids, side-channel host:port, lease ids;
encoder-cache transfer params alike) and never reach a client: removed from JSON answers
and from every streamed event (vLLM 0.33 also puts `kv_transfer_params` on a stream's
last chunk, and `"kv_transfer_params": null` on each completions chunk)."""

PREFILL_DROP = ("stream_options", "min_tokens", "logprobs", "top_logprobs", "n", "best_of",
                "echo", "prompt_logprobs", "return_token_ids")
"""Removed for the prefill leg: no stream there, min_tokens > 1 would clash with max 1, and
P's single throw-away token needs no logprobs (vLLM 0.32 omits kv_transfer_params from a
response that asked for logprobs, which would silently turn the request into a recompute)."""

CHAT = "chat"
COMPLETIONS = "completions"


def sanitize(body: dict[str, Any]) -> dict[str, Any]:
    """Copy of the client body without router-owned fields."""
    return {k: v for k, v in body.items() if k not in ROUTER_FIELDS}


def prefill_body(
    clean: dict[str, Any], endpoint: str, kv_params: dict[str, Any]
) -> dict[str, Any]:
    """The prefill leg: same prompt, one token, no stream, asked to keep its KV for D."""
    body = {k: v for k, v in clean.items() if k not in PREFILL_DROP}
    body["max_tokens"] = 1
    if endpoint == CHAT:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    body["kv_transfer_params"] = dict(kv_params)
    return body


def pull_prefill_params(transfer_id: str) -> dict[str, Any]:
    """kv_transfer_params sent to P in pull mode: keep the blocks for a remote decode."""
    return kv.pull_prefill_params(transfer_id)


def decode_body(clean: dict[str, Any], kv_params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode leg: the client's original request plus P's params (if P gave any)."""
    body = dict(clean)
    if kv_params is not None:
        body["kv_transfer_params"] = dict(kv_params)
    return body


def encode(body: dict[str, Any]) -> bytes:
    """JSON bytes of a leg body (msgspec: ~10x faster than json.dumps on long prompts)."""
    return msgspec.json.encode(body)


def decode(data: bytes) -> Any:
    """A client body; raises ValueError when it is not JSON."""
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError as e:
        raise ValueError(str(e)) from e


def scrub_engine_fields(obj: Any) -> dict[str, Any]:
    """Remove ENGINE_FIELDS from an answer object in place; returns what was removed."""
    if not isinstance(obj, dict):
        return {}
    return {k: obj.pop(k) for k in ENGINE_FIELDS if k in obj}


def extract_kv_params(response_json: Any) -> dict[str, Any] | None:
    """P's top-level `kv_transfer_params` when it is a non-empty dict, else None."""
    if not isinstance(response_json, dict):
        return None
    params = response_json.get("kv_transfer_params")
    if isinstance(params, dict) and params:
        return params
    return None


def token_ids(value: Any) -> list[int] | None:
    """`value` when it is a prompt of token ids (a non-empty list of ints, no bools), else
    None. Checked by msgspec in C: the Python loop it replaces took 1-6 ms of router CPU
    per 16k-token request, and the router asked three times on the TTFT path."""
    if not isinstance(value, list) or not value:
        return None
    try:
        msgspec.convert(value, list[int], strict=True)
    except msgspec.ValidationError:
        return None
    return value


def wants_stream(body: dict[str, Any]) -> bool:
    """True when the client asked for SSE."""
    return bool(body.get("stream", False))
