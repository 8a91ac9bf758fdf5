"""The router's SSE event framing and token-id check: the fast paths give exactly what
the regex and the Python loop they replace gave."""

from __future__ import annotations

import random
import re

import pytest

from kvferry.router.wire.bodies import token_ids
from kvferry.router.wire.sse_framing import EVENT_END, event_ends, last_event_end, plain_token_ids


def _regex(data: bytes) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for m in EVENT_END.finditer(data)]


@pytest.mark.parametrize("alphabet", [b"ab\n", b"a\r\n", b"data: {}[]1,\n\n"])
def test_event_ends_match_the_regex(alphabet: bytes) -> None:
    rng = random.Random(len(alphabet))
    for _ in range(3000):
        data = bytes(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
        want = _regex(data)
        assert list(event_ends(data)) == want, data
        assert last_event_end(data) == (want[-1][1] if want else 0), data


def test_event_ends_of_a_long_first_event() -> None:
    ids = ",".join(str(i) for i in range(16384)).encode()
    data = b'data: {"prompt_token_ids":[' + ids + b']}\n\ndata: {"a":1}\n\ndata: [DO'
    assert list(event_ends(data)) == _regex(data)
    assert data[last_event_end(data):] == b"data: [DO"


def test_token_ids() -> None:
    assert token_ids([1, 2, 3]) == [1, 2, 3]
    for bad in ([], [1, True], [1, 2.0], [1, "a"], "123", None, {"a": 1}, [[1]]):
        assert token_ids(bad) is None, bad
    big = list(range(16384))
    assert token_ids(big) is big  # the caller's list, not a copy


_IDS = re.compile(rb'"token_ids":\[([0-9, ]*)\]')


def _plain_by_regex(event: bytes) -> tuple[list[int], int, int] | None:
    """`plain_token_ids` as it was written first (one regex over the event)."""
    if (not event.startswith(b"data: {") or b'"finish_reason":null' not in event
            or b'"error"' in event or b"prompt_token_ids" in event or b'"role"' in event
            or event.count(b'"token_ids":') != 1):
        return None
    m = _IDS.search(event)
    if m is None:
        return None
    try:
        ids = [int(i) for i in m.group(1).split(b",")] if m.group(1).strip() else []
    except ValueError:
        return None
    return ids, m.start(), m.end()


def test_plain_token_ids_match_the_regex() -> None:
    """Random events built from vLLM's pieces and broken ones: the search-only fast path
    answers exactly what the regex did, with or without the event's blank line."""
    rng = random.Random(7)
    heads = [b'data: {"id":"c","choices":[{"index":0,"text":" a","finish_reason":null,',
             b'data: {"choices":[{"delta":{"role":"assistant"},"finish_reason":null,',
             b'data: {"error":{"message":"x"},"finish_reason":null,', b"data: [DONE]",
             b'data: {"choices":[{"finish_reason":"length",', b'event: x\ndata: {"a":1,']
    ids = [b"[102]", b"[1,2, 3]", b"[]", b"[ ]", b"[1,,2]", b"[-1]", b"[1_0]", b"null",
           b"[12", b"[\xd9\xa3]", b"[1]", b"[007]"]
    tails = [b"}]}", b',"prompt_token_ids":[7]}]}', b',"token_ids":[5]}]}', b""]
    for _ in range(5000):
        event = (rng.choice(heads) + b'"token_ids":' + rng.choice(ids) + rng.choice(tails)
                 + rng.choice([b"", b"\n\n"]))
        assert plain_token_ids(event) == _plain_by_regex(event), event
