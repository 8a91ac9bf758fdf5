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


_BODY_OPENS = (b'"text":"', b'"delta":{"content":"')
"""Where a completions and a chat token event's text opens (vLLM's key order)."""


class TokenShape:
    """The bytes one stream's plain token events share, learnt from one of them.

    Within a stream, vLLM writes every plain token event (completions or chat, one
    choice, no logprobs) with the same id, `created`, model and keys: only the text and
    the one token id differ. `match` checks a later event against those bytes, head and
    tail compared, one search for the middle: ~4x quicker than `plain_token_ids`. An event
    it accepts has exactly the keys and values of the event it was learnt from, which
    `plain_token_ids` had vouched for (and that an engine-field filter had passed).

    Why the middle's first occurrence is where the text ends: the text holds no `"` before
    it (checked), and were that `"` escaped by a trailing backslash, the string would end
    at the middle's next quote, which no backslash precedes, and the keys after it would
    not be JSON. An engine's event is JSON."""

    __slots__ = ("_head", "_mid", "_tail", "_n_head", "_n_mid", "_n_tail")

    def __init__(self, head: bytes, mid: bytes, tail: bytes) -> None:
        self._head, self._mid, self._tail = head, mid, tail
        self._n_head, self._n_mid, self._n_tail = len(head), len(mid), len(tail)

    @classmethod
    def of(cls, event: bytes, ids: tuple[int, int]) -> TokenShape | None:
        """The shape of `event`, a whole plain token event (with its blank line) whose
        `"token_ids":[N]` spans `ids`; None if its text holds a quote or backslash, or its
        shape is not one `match` can vouch for."""
        start, end = ids
        for key in _BODY_OPENS:
            at = event.find(key)
            if at >= 0:
                break
        else:
            return None
        opened = at + len(key)
        closed = event.find(b'"', opened)
        n_ids = len(_IDS_OPEN)
        if (closed < 0 or closed > start or event.find(b"\\", opened, closed) >= 0
                or not event[start + n_ids:end - 1].isdigit()):
            return None
        mid = event[closed:start + n_ids]
        second = mid.find(b'"', 1)
        if second < 0 or mid[second - 1] == 0x5C:  # the proof above needs that quote
            return None
        return cls(event[:opened], mid, event[end - 1:])

    def match(self, event: bytes) -> tuple[int, int, int] | None:
        """For an event of this shape: its token id and the (start, end) of its
        `"token_ids":[N]`; else None."""
        n_head = self._n_head
        if not event.startswith(self._head):
            return None
        i = event.find(self._mid, n_head)
        if i < 0 or event.find(b'"', n_head, i) >= 0:
            return None
        j = i + self._n_mid
        k = len(event) - self._n_tail
        if k <= j or not event.endswith(self._tail):
            return None
        digits = event[j:k]
        if not digits.isdigit():
            return None
        return int(digits), j - len(_IDS_OPEN), k + 1
