"""The chaos run, bounded for CI (scripts/chaos.py; `kvferry chaos` runs longer ones).

Two prefill and two decode vLLM CPU engines behind the router, three clients sending
pull and push, completions and chat, streamed and not, single prompts and conversations
that reuse D's KV, while a seeded injector goes through every fault once: SIGKILL and
restart (same address) of a P, a D and the router; dropped and delayed NIXL
notifications; dropped and delayed lease-control calls; failed transfer posts; READs
reported past their deadline; a lease released while P reads it back; forged and
malformed kv_transfer_params; prompts over the context length; bytes flipped in blocks a
READ delivered. The books must balance: every answer equals colocated or is a clear
error, no hang, every block freed, no crash, router memory bounded; every READ's blocks
are checksummed, and each byte the corrupt fault flips is caught (that READ fails its
check and the request recomputes). Wall time: ~2 min start-up, `DURATION_S` of faults,
the settle bound (chaos_stack.settle_bound_s) at most: under 8 minutes on two cores.
"""

from __future__ import annotations

import pytest

from kvferry.scripts.chaos import print_books, run
from kvferry.scripts.chaos_faults import HOOKS, KINDS, schedule

pytestmark = pytest.mark.engine

SEED = 7
DURATION_S = 150.0  # 14 faults 10 s apart: every kind once


def test_every_kind_fits_the_ci_run():
    kinds = [k for _, k in schedule(SEED, DURATION_S)]
    assert sorted(set(kinds)) == sorted(KINDS), kinds


# Its own per-test bound (pyproject's is 600 s): start-up, faults and settling take up to
# 8 minutes on two cores (the module docstring), so 20 leave room for a busier runner.
@pytest.mark.timeout(1200)
def test_chaos_books_balance(tmp_path, capsys):
    books, facts = run(SEED, DURATION_S, tmp_path / "chaos", workers=3)
    with capsys.disabled():
        print_books(books)
    assert books.violations == [], books.violations
    injected = {e["fault"] for e in facts["events"]}
    assert injected == set(KINDS), injected  # no process fault was replaced by a hook fault
    for e in facts["events"]:
        assert "injector error" not in e["detail"], e
    # The hooks fired in the engines and the router: those every window is sure to meet
    # (lease windows send their own lease-control traffic; posts and finished transfers
    # come with any request). The others depend on what the traffic did in the window.
    points = {k.split(":")[0] for k in books.hook_hits}
    assert {"lease_call", "lease_handle", "post", "done_hold", "corrupt"} <= points, books.hook_hits
    # Every READ is checked (CHAOS_EXTRA): each flipped byte failed its READ's check, and
    # no check failed for any other reason (the books also count this as a violation).
    assert books.corruptions_injected >= 1, books.hook_hits
    assert books.corruptions_caught == books.corruptions_injected == books.hook_hits["corrupt:flip"]
    holds = [e["detail"] for e in facts["events"] if e["fault"] == "read_hold"]
    assert holds and all(" held=0" not in d for d in holds), holds  # each window held a READ
    assert points <= {r["point"] for rules in HOOKS.values() for r in rules}
    kinds = [o.kind for o in books.outcomes]
    assert kinds.count("ok") >= 40, f"too little traffic got through: {kinds}"
    oversize = [o for o in books.outcomes if o.item.fault == "oversize"]
    assert oversize and all(o.kind == "error" and o.status == 400 for o in oversize), oversize
    forged = {o.item.fault.split(":")[1]: o for o in books.outcomes
              if o.item.fault.startswith("forged_params")}
    assert len(forged) == 6, forged
    for name, o in forged.items():  # refused and recomputed, or refused as a bad request
        bad_request = o.kind == "error" and 400 <= o.status < 500
        # (a connection error only while its engine was being killed: the books say so)
        assert o.kind in ("ok", "conn_error") or bad_request, (name, o.kind, o.status, o.detail)
    # The router drops client-supplied params: the right answer (or, in flight when the
    # router was killed, a broken connection, which the books allow only then).
    assert forged["client_params_to_router"].kind in ("ok", "conn_error")
