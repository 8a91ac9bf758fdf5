"""Per-transfer wall-clock marks: where a push handoff's milliseconds go.

Off unless ``KVFERRY_TIMELINE=1``. Each mark is one log line
``kvferry-timeline <transfer id> <event> <unix time>`` written by whichever process saw the
event (P's scheduler and transfer thread, D's, the router), so lines from all of them join
by transfer id; P, D and the router of one benchmark share a host clock. `summarize` turns
the joined marks into median gaps between consecutive events.
"""

from __future__ import annotations

import logging
import os
import re
import statistics
import time
from collections.abc import Iterable, Sequence

ENABLED = os.environ.get("KVFERRY_TIMELINE") == "1"

# A push request's events in the order they normally happen.
PUSH_EVENTS = (
    "client_sent",    # benchmark client: request sent (tests/gpu/bench_pd.py joins it)
    "router_in",      # router: request received, before its body was parsed
    "dispatched",     # router: both legs sent
    "registered",     # D transfer thread: Register notification sent to P
    "last_chunk_scheduled",  # P scheduler (early push): the prompt's last chunk planned
    "forward_done",   # P transfer thread (early push): that forward's fence passed
    "prefill_end",    # P scheduler: the prefill's last step was processed
    "write_start",    # P transfer thread: WRITE posted (layer-wise: matched, posting begins)
    "p_answered",     # router: P's HTTP answer arrived
    "write_done",     # P transfer thread: WRITE complete
    "kv_in",          # D transfer thread: P's Wrote notification arrived
    "kv_seen",        # D scheduler: the request's KV reported received
    "scheduled",      # D scheduler: the request scheduled for its first token
    "d_token_out",    # D scheduler: that step's output processed, the first token exists
    "d_first_byte",   # router: D's first streamed chunk
    "client_first_byte",  # benchmark client: the first token's chunk arrived
)

_LINE = re.compile(r"kvferry-timeline (\S+) (\S+) ([\d.]+)")


def mark(log: logging.Logger, transfer_id: str, event: str, at: float | None = None) -> None:
    if ENABLED and transfer_id:
        log.info("kvferry-timeline %s %s %.6f", transfer_id, event,
                 time.time() if at is None else at)


def parse(lines: Iterable[str]) -> dict[str, dict[str, float]]:
    """transfer id -> event -> first time seen."""
    out: dict[str, dict[str, float]] = {}
    for ln in lines:
        for tid, event, t in _LINE.findall(ln):
            out.setdefault(tid, {}).setdefault(event, float(t))
    return out


def summarize(marks: dict[str, dict[str, float]], events: Sequence[str] = PUSH_EVENTS
              ) -> dict[str, float]:
    """Median milliseconds from each event to the next one present, over the transfers
    that have both, plus ``p_answered->d_first_byte`` (the router-side handoff)."""
    out: dict[str, float] = {}
    pairs = list(zip(events, events[1:], strict=False)) + [
        ("p_answered", "d_first_byte"), ("prefill_end", "kv_in"), ("forward_done", "write_start"),
        ("forward_done", "kv_in"),
        # layer-wise push (transfer/layer_push.py): P's first and last layer batch posted
        ("last_chunk_scheduled", "first_layer_posted"),
        ("first_layer_posted", "last_layer_posted"), ("last_layer_posted", "forward_done"),
        ("forward_done", "write_done"), ("kv_in", "scheduled"),
        # router: P's token 1 sent to the client before D's (router/legs/first_token.py)
        ("p_answered", "p_token_out"), ("p_token_out", "client_first_byte"),
        # engine core -> its API server -> the router, on P and on D
        ("prefill_end", "p_answered"), ("d_token_out", "d_first_byte"),
        ("scheduled", "d_first_byte")]
    for a, b in pairs:
        gaps = [(m[b] - m[a]) * 1e3 for m in marks.values() if a in m and b in m]
        if gaps:
            out[f"{a}->{b}"] = round(statistics.median(gaps), 2)
    out["transfers"] = len(marks)
    return out
