"""The router's SSE event framing and token-id check: the fast paths give exactly what
the regex and the Python loop they replace gave."""

from __future__ import annotations

import random

import pytest

from kvferry.router.wire.bodies import token_ids
from kvferry.router.wire.sse_framing import EVENT_END, event_ends, last_event_end


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
