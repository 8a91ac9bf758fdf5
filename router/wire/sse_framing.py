"""Where the events of an SSE byte stream end, and what a plain token event holds: shared
by every filter the router runs over an engine's stream (engine-field scrubbing, stream
migration, answer capture), all on bytes."""

from __future__ import annotations

import re
from collections.abc import Iterator

EVENT_END = re.compile(rb"\r?\n\r?\n")
"""An event ends with a blank line; lines may end with CRLF."""


def event_ends(data: bytes) -> Iterator[tuple[int, int]]:
    """(start, end) of each event separator in `data`, left to right, as
    ``EVENT_END.finditer`` finds them. vLLM ends events with a bare blank line, so without
    a CR this is `bytes.find`: the regex took ~1 ms per pass over the first event of a
    16k-token stream (its prompt_token_ids), and each filter scans a chunk twice."""
    if b"\r" in data:
        for m in EVENT_END.finditer(data):
            yield m.start(), m.end()
        return
    pos = 0
    while (i := data.find(b"\n\n", pos)) >= 0:
        yield i, i + 2
        pos = i + 2


def last_event_end(data: bytes) -> int:
    """How many leading bytes of `data` are whole events (0: none yet). One `rfind` on
    the token path; a scan only where a run of 3+ newlines makes the split ambiguous."""
    if b"\r" not in data:
        i = data.rfind(b"\n\n")
        if i < 0:
            return 0
        if i == 0 or data[i - 1] != 0x0A:
            return i + 2
    ends = [end for _, end in event_ends(data)]
    return ends[-1] if ends else 0


_UNFINISHED = b'"finish_reason":null'
_PROMPT_IDS_KEY = b'"prompt_token_ids":'
_NO_PROMPT_IDS = b'"prompt_token_ids":null'
_TOKEN_IDS_KEY = b'"token_ids":'
_IDS_OPEN = b'"token_ids":['
_ID_LIST = re.compile(rb"[0-9, ]*")


_VLLM_TOKEN = re.compile(
    rb'data: \{"id":"[^"\\]*","object":"text_completion","created":\d+,"model":"[^"\\]*",'
    rb'"choices":\[\{"index":\d+,"text":"(?:[^"\\]|\\.)*","logprobs":null,'
    rb'"finish_reason":null,"stop_reason":null,(?:"prompt_token_ids":null,)?'
    rb'("token_ids":\[(\d+)\])\}\](?:,"usage":null)?\}(?:\n\n)?')
"""A vLLM completions token event, whole (vLLM 0.32's field order, `CompletionStream-
Response`): one match vouches for everything `plain_token_ids` checks, in a third of the
time of its searches. Any other shape takes those searches."""


def plain_token_ids(event: bytes) -> tuple[list[int], int, int] | None:
    """For the common event (one choice's next token, not the last: no error, role, prompt
    ids or finish reason; the `"prompt_token_ids":null` vLLM 0.32 writes into every
    completions event after the first is no prompt ids) its token ids and the (start, end)
    of its `"token_ids":[...]`; None when the event needs parsing. Safe on bytes: JSON
    escapes every quote inside a string, so `"token_ids":` can only be a key. `event` may
    end with its blank line.

    On the token path: substring searches only (a regex over the event took most of
    this function's ~2 us), and one id (vLLM's streams send one per event) is read
    with `int` once `isdigit` vouched for it."""
    if (m := _VLLM_TOKEN.fullmatch(event)) is not None:
        return [int(m[2])], m.start(1), m.end(1)
    if (not event.startswith(b"data: {") or _UNFINISHED not in event
            or b'"error"' in event or b'"role"' in event):
        return None
    at = event.find(_PROMPT_IDS_KEY)  # vLLM's completions events all carry the key
    while at >= 0:
        if not event.startswith(_NO_PROMPT_IDS, at):
            return None  # the prompt's ids: parsed, recorded
        at = event.find(_PROMPT_IDS_KEY, at + len(_NO_PROMPT_IDS))
    start = event.find(_TOKEN_IDS_KEY)
    if (start < 0 or not event.startswith(_IDS_OPEN, start)
            or event.find(_TOKEN_IDS_KEY, start + 1) >= 0):
        return None  # no id list, or a second key
    first = start + len(_IDS_OPEN)
    close = event.find(b"]", first)
    if close < 0:
        return None
    inner = event[first:close]
    if inner.isdigit():
        ids = [int(inner)]
    elif _ID_LIST.fullmatch(inner) is not None:
        try:
            ids = [int(i) for i in inner.split(b",")] if inner.strip() else []
        except ValueError:  # "1,,2"
            return None
    else:
        return None
    return ids, start, close + 1
