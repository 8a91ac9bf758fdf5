"""Test-only fault injection at the transport and lease-control seams (chaos runs).

OFF unless ``$KVFERRY_FAULTS`` names a fault plan file when the process starts: then
`ACTIVE` is False, every hook is one attribute test at its call site (``if faults.ACTIVE
and ...``) and no behaviour changes. A plan is JSON the chaos harness rewrites while it
runs (re-read at most every `RELOAD_S`)::

    {"seed": 7, "events": "/tmp/run/faults", "rules": [
        {"point": "notify", "action": "drop", "p": 0.3},
        {"point": "lease_handle", "action": "delay", "p": 1.0, "s": 3.0}]}

Points: ``notify`` (a NIXL notification about to be sent), ``notif_in`` (one received),
``post`` (a READ/WRITE about to be posted), ``peer_add`` (a peer's handshake metadata
about to be loaded), ``done_hold`` (a finished transfer about to be reported),
``lease_handle`` (D answering a lease-control request), ``lease_call`` (the router's
lease-control request), ``step`` (an engine step begins, before its forward: a ``delay``
slows the engine, so a test can act on a request while it still runs), ``corrupt`` (a
READ or push WRITE that ended: one byte of its first block is flipped before the receiver
checks it, `hit`). Actions: ``drop`` (the message is lost, the post or peer set-up
fails), ``delay`` (sleep ``s`` seconds first; ``done_hold``: report DONE ``s`` seconds
late). A rule with ``tags`` applies only in the processes named there (their
``$KVFERRY_FAULTS_TAG``). ``p`` is the chance per event,
drawn from a generator seeded by the plan's seed and the tag, so a run's decisions replay.
Each hit is appended as a JSON line to ``<events>/<tag>-<pid>.jsonl``: what the harness
counts.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path
from typing import Any

ENV = "KVFERRY_FAULTS"
TAG_ENV = "KVFERRY_FAULTS_TAG"
RELOAD_S = 0.5
POINTS = ("notify", "notif_in", "post", "peer_add", "done_hold", "lease_handle", "lease_call",
          "corrupt", "step")

ACTIVE = bool(os.environ.get(ENV))


class InjectedFault(RuntimeError):
    """Raised at a ``drop`` of ``post`` / ``peer_add``: the caller's failure path runs."""


class _Plan:
    def __init__(self, path: str, tag: str) -> None:
        self.path = Path(path)
        self.tag = tag
        self.rules: list[dict[str, Any]] = []
        self.events: Path | None = None
        self.rng = random.Random(tag)
        self._seed: Any = None
        self._mtime = -1.0
        self._checked = 0.0
        self._held: dict[int, float] = {}

    def current(self, point: str) -> list[dict[str, Any]]:
        now = time.monotonic()
        if now - self._checked >= RELOAD_S:
            self._checked = now
            self._reload()
        return [r for r in self.rules if r.get("point") == point
                and (not r.get("tags") or self.tag in r["tags"])]

    def _reload(self) -> None:
        try:
            mtime = self.path.stat().st_mtime
            if mtime == self._mtime:
                return
            plan = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.rules = []  # no plan (yet, or being rewritten): no faults
            return
        self._mtime = mtime
        self.rules = [r for r in plan.get("rules", []) if isinstance(r, dict)]
        ev = plan.get("events")
        self.events = Path(ev) if ev else None
        if plan.get("seed") != self._seed:
            self._seed = plan.get("seed")
            self.rng = random.Random(f"{self._seed}:{self.tag}")

    def draw(self, point: str) -> dict[str, Any] | None:
        """The rule that fires for this event at ``point``, if any (first match)."""
        for rule in self.current(point):
            if self.rng.random() < float(rule.get("p", 1.0)):
                self.record(point, rule)
                return rule
        return None

    def record(self, point: str, rule: dict[str, Any]) -> None:
        if self.events is None:
            return
        line = json.dumps({"t": time.time(), "tag": self.tag, "point": point,
                           "action": rule.get("action"), "s": rule.get("s")})
        try:
            self.events.mkdir(parents=True, exist_ok=True)
            with open(self.events / f"{self.tag or 'proc'}-{os.getpid()}.jsonl", "a") as f:
                f.write(line + "\n")
        except OSError:
            pass


_PLAN: _Plan | None = _Plan(os.environ[ENV], os.environ.get(TAG_ENV, "")) if ACTIVE else None


def _rule(point: str) -> dict[str, Any] | None:
    return _PLAN.draw(point) if _PLAN is not None else None


def lost(point: str) -> bool:
    """True when this event is dropped; a ``delay`` rule sleeps first and returns False."""
    rule = _rule(point)
    if rule is None:
        return False
    if rule.get("action") == "delay":
        time.sleep(float(rule.get("s", 1.0)))
        return False
    return rule.get("action") == "drop"


async def lost_async(point: str) -> bool:
    """`lost` for an asyncio caller (the router): a delay does not block its loop."""
    rule = _rule(point)
    if rule is None:
        return False
    if rule.get("action") == "delay":
        await asyncio.sleep(float(rule.get("s", 1.0)))
        return False
    return rule.get("action") == "drop"


def fail(point: str) -> None:
    """Raise `InjectedFault` when this event is dropped (a delay sleeps, then passes)."""
    if lost(point):
        raise InjectedFault(f"injected fault at {point}")


def hit(point: str) -> bool:
    """True when a rule at ``point`` fires for this event, whatever its action (``corrupt``)."""
    return _rule(point) is not None


def unreachable() -> dict[str, Any]:
    """What a lost lease-control call looks like to its caller (`lease_control.call`)."""
    return {"ok": False, "error": "unreachable"}


def kept(point: str, items: list[Any]) -> list[Any]:
    """The received items that are not dropped (each one drawn on its own)."""
    return [x for x in items if not lost(point)]


def held(xfer: Any, state: str) -> str:
    """A transfer that ended DONE is reported PROC for a ``done_hold`` rule's ``s``
    seconds more (a READ that outlives its lease or deadline)."""
    if _PLAN is None or state != "DONE":
        return state
    key = id(xfer)
    until = _PLAN._held.get(key)
    if until is None:
        rule = _rule("done_hold")
        if rule is None:
            return state
        until = _PLAN._held[key] = time.monotonic() + float(rule.get("s", 1.0))
    if time.monotonic() < until:
        return "PROC"
    _PLAN._held.pop(key, None)
    return state
