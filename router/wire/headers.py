"""What the router adds to an answer, by name, for the router and its clients alike (the
demo, `kvferry bench`); importing this module pulls in nothing else.

Answers carry it as headers. A push stream's headers leave before P has finished, so
there the P leg's values travel in one SSE comment line before `data: [DONE]`
(`: kvferry {"kvferry_reused_tokens": ...}`): SSE clients (the OpenAI SDK among them)
skip comments, so every event a client parses is one vLLM itself could send. A header
wins over a field.

Engine identity (OPERATOR_HEADERS and the P time) reaches only callers with the operator
token (router/api/auth.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

HDR_PREFILL = "x-kvferry-prefill"
HDR_DECODE = "x-kvferry-decode"
HDR_TRANSFER = "x-kvferry-transfer-id"
HDR_ROUTE = "x-kvferry-route"
HDR_FIRST_TOKEN = "x-kvferry-first-token"
"""Request header: `decode` keeps a push stream's first token D's own (benchmarks compare
both; router/legs/first_token.py)."""
"""Answers: "d_local" when the conversation's D served the turn from its own prefix cache
(no P leg). Requests: "prefill" keeps the turn on P (benchmarks, tests)."""
HDR_PREFILL_MS = "x-kvferry-prefill-ms"
"""Duration of the P leg in ms (absent: no handoff can be derived)."""
HDR_REUSED = "x-kvferry-reused-tokens"
"""Conversation turns: history tokens P read back from D instead of recomputing."""
HDR_REUSE_REASON = "x-kvferry-reuse-reason"
"""Why (not): "ok", "local_hit_covers" (P's prefix cache held it), "below_threshold"..."""
OPERATOR_HEADERS = (HDR_PREFILL, HDR_DECODE, HDR_TRANSFER, HDR_PREFILL_MS)
"""Engine identity and P's time: removed from answers to callers without the operator
token."""
OPERATOR_TOKEN_HEADER = "x-kvferry-operator-token"
"""Request header: the operator token, which unlocks engine identity (router/api/auth.py)."""
OPERATOR_TOKEN_ENV = "KVFERRY_OPERATOR_TOKEN"
REPORT_COMMENT = b": kvferry "
"""Start of a push stream's report line (an SSE comment) of router fields."""
BODY_PREFILL_MS = "kvferry_prefill_ms"
BODY_REUSED = "kvferry_reused_tokens"
BODY_REUSE_REASON = "kvferry_reuse_reason"


def report_comment(fields: Mapping[str, Any]) -> bytes:
    """The SSE comment carrying a push stream's router fields (JSON on one line)."""
    return REPORT_COMMENT + json.dumps(dict(fields), separators=(",", ":")).encode() + b"\n\n"


def parse_report_comment(line: str) -> dict[str, Any] | None:
    """The router fields of one SSE line when it is a report comment, else None."""
    if not line.startswith(REPORT_COMMENT.decode()):
        return None
    try:
        out = json.loads(line[len(REPORT_COMMENT):])
    except ValueError:
        return None
    return out if isinstance(out, dict) else None


def reuse_report(headers: Mapping[str, str], fields: Mapping[str, Any]
                 ) -> tuple[int, str] | None:
    """(Reused tokens, reason) from an answer's headers, else from its router fields;
    None when the router reported nothing (a first turn, or no conversation)."""
    if (h := headers.get(HDR_REUSED)) is not None:
        try:
            return int(h), str(headers.get(HDR_REUSE_REASON, ""))
        except ValueError:
            return None
    n = fields.get(BODY_REUSED)
    if isinstance(n, int) and not isinstance(n, bool):
        return n, str(fields.get(BODY_REUSE_REASON, ""))[:64]
    return None
