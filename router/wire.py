"""What the router adds to an answer, by name, for the router and its clients alike (the
demo, `kvferry bench`); importing this module pulls in nothing else.

Pull answers carry it as headers. A push answer's headers leave before P has finished, so
there the P leg's values travel as top-level fields: of the JSON body, or of one extra SSE
event (`{"choices": [], ...}`) before `data: [DONE]`. A header wins over a field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

HDR_PREFILL = "x-kvferry-prefill"
HDR_DECODE = "x-kvferry-decode"
HDR_TRANSFER = "x-kvferry-transfer-id"
HDR_ROUTE = "x-kvferry-route"
HDR_FIRST_TOKEN = "x-kvferry-first-token"
"""Request header: `decode` keeps a push stream's first token D's own (benchmarks compare
both; router/first_token.py)."""
"""Answers: "d_local" when the conversation's D served the turn from its own prefix cache
(no P leg). Requests: "prefill" keeps the turn on P (benchmarks, tests)."""
HDR_PREFILL_MS = "x-kvferry-prefill-ms"
"""Duration of the P leg in ms (absent: no handoff can be derived)."""
HDR_REUSED = "x-kvferry-reused-tokens"
"""Conversation turns: history tokens P read back from D instead of recomputing."""
HDR_REUSE_REASON = "x-kvferry-reuse-reason"
"""Why (not): "ok", "local_hit_covers" (P's prefix cache held it), "below_threshold"..."""
BODY_PREFILL_MS = "kvferry_prefill_ms"
BODY_REUSED = "kvferry_reused_tokens"
BODY_REUSE_REASON = "kvferry_reuse_reason"


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
