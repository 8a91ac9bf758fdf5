"""The chaos run's fault injector: a seeded schedule of faults, and each fault's action.

Process faults SIGKILL a prefill engine, a decode engine or the router and start it again
on the same address (the others then hold a stale NIXL agent or connection for it).
Hook faults rewrite the plan file the engines and the router read
(connectors/transfer/faults.py) for a few seconds. Request faults send what a careless
or hostile client might: forged or malformed kv_transfer_params (to the router, which
must drop them, and straight to the engines, which must refuse them and recompute),
prompts longer than the model's context, and a conversation released while P reads its
history back.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from .chaos_stack import MAX_MODEL_LEN, ChaosStack, Proc
from .chaos_traffic import Item, Outcome, Workload, completion, send, tokens

WINDOW_S = 10.0  # how long a hook fault stays on
LEASE_GRACE_S = 90.0  # how long past its window a lease fault waits for the router

# fault -> (hook rules while it is on, or None for process/request faults)
HOOKS: dict[str, list[dict[str, Any]]] = {
    "notif_drop": [{"point": "notify", "action": "drop", "p": 0.3},
                   {"point": "notif_in", "action": "drop", "p": 0.3}],
    "notif_delay": [{"point": "notify", "action": "delay", "p": 0.5, "s": 3.0}],
    "lease_drop": [{"point": "lease_call", "action": "drop", "p": 1.0, "tags": ["router"]},
                   {"point": "lease_handle", "action": "drop", "p": 0.5}],
    "lease_delay": [{"point": "lease_handle", "action": "delay", "p": 1.0, "s": 3.0}],
    "transport_fail": [{"point": "post", "action": "drop", "p": 0.5}],
    # A failed post makes D forget that peer; meeting it again then fails too (its
    # handshake metadata is refused): the side channel is broken for the window.
    "side_channel": [{"point": "post", "action": "drop", "p": 0.3},
                     {"point": "peer_add", "action": "drop", "p": 1.0}],
    "read_hold": [{"point": "done_hold", "action": "delay", "p": 0.5, "s": 25.0}],
    # A byte flipped in blocks a READ delivered (the engines check every READ: CHAOS_EXTRA).
    "corrupt": [{"point": "corrupt", "action": "flip", "p": 0.5}],
}
PROCESS = ("kill_p", "kill_d", "kill_router")
REQUESTS = ("forged_params", "oversize", "lease_expire_mid_read")
KINDS = (*PROCESS, *HOOKS, *REQUESTS)


@dataclass
class FaultEvent:
    """One injected fault: when, on what, and the requests that met it."""

    kind: str
    t0: float
    t1: float = 0.0
    target: str = ""
    detail: str = ""
    outcomes: list[Outcome] = field(default_factory=list)


def hook_events(events: Path) -> list[dict[str, Any]]:
    """Every hook hit the processes wrote so far (connectors/transfer/faults.py: one JSON
    line per hit under ``events``); a line still being written is skipped."""
    out: list[dict[str, Any]] = []
    for f in sorted(events.glob("*.jsonl")) if events.exists() else []:
        with contextlib.suppress(OSError):
            for ln in f.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    out.append(json.loads(ln))
    return out


class Plan:
    """The fault plan file: rules on now, rewritten atomically."""

    def __init__(self, path: Path, seed: int, events: Path) -> None:
        self.path, self.seed, self.events = path, seed, events
        self._on: dict[str, list[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._write()

    def _write(self) -> None:
        rules = [r for rs in self._on.values() for r in rs]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"seed": self.seed, "events": str(self.events),
                                   "rules": rules}))
        tmp.replace(self.path)

    def on(self, key: str, rules: list[dict[str, Any]]) -> None:
        with self._lock:
            self._on[key] = rules
            self._write()

    def off(self, key: str) -> None:
        with self._lock:
            self._on.pop(key, None)
            self._write()


def schedule(seed: int, duration_s: float, every_s: float = 10.0) -> list[tuple[float, str]]:
    """(seconds into the run, fault): every kind once in a seeded order, the process
    faults among the first six (an engine takes a minute or two to start again on two
    busy cores, and the books wait for it), then seeded picks, one every ``every_s``."""
    rng = random.Random(seed)
    n = max(1, int((duration_s - 10) // every_s))
    procs = list(PROCESS)
    others = [k for k in KINDS if k not in PROCESS]
    rng.shuffle(procs)
    rng.shuffle(others)
    kinds = [k for pair in zip(others, procs, strict=False) for k in pair] + others[len(procs):]
    while len(kinds) < n:
        kinds.append(rng.choice(KINDS))
    return [(8.0 + i * every_s, k) for i, k in enumerate(kinds[:n])]


class Injector:
    """Injects the plan's faults into a running chaos stack, one window at a time."""

    def __init__(self, stack: ChaosStack, work: Workload, plan: Plan, seed: int,
                 record: Callable[[Outcome], None], startup_s: float) -> None:
        self.stack, self.work, self.plan, self.record = stack, work, plan, record
        self.rng = random.Random(seed * 7919 + 1)
        self.seed = seed
        self.startup_s = startup_s
        self.events: list[FaultEvent] = []
        self.restarting: dict[str, threading.Thread] = {}  # role -> restart in progress
        self._threads: list[threading.Thread] = []
        self.client = httpx.Client(trust_env=False)

    def run(self, t_start: float, plan: list[tuple[float, str]], stop: threading.Event) -> None:
        for at, kind in plan:
            if stop.wait(max(0.0, t_start + at - time.monotonic())):
                break
            self._spawn(kind)
        for th in self._threads:
            th.join()
        self.client.close()

    def _spawn(self, kind: str) -> None:
        if kind in PROCESS:
            role = {"kill_p": "prefill", "kill_d": "decode", "kill_router": "router"}[kind]
            busy = self.restarting.get(role)
            if busy is not None and busy.is_alive():  # keep one engine of each role up
                kind = self.rng.choice(tuple(HOOKS))
        ev = FaultEvent(kind, time.time())
        self.events.append(ev)
        th = threading.Thread(target=self._do, args=(ev,), daemon=True, name=f"fault-{kind}")
        if kind in PROCESS:
            self.restarting[{"kill_p": "prefill", "kill_d": "decode",
                             "kill_router": "router"}[kind]] = th
        self._threads.append(th)
        th.start()

    def _do(self, ev: FaultEvent) -> None:
        try:
            getattr(self, "_" + ev.kind, self._hook)(ev)
        except Exception as e:  # a fault that could not be injected is reported, not fatal
            ev.detail = f"injector error: {e!r}"[:300]
        ev.t1 = time.time()

    # -- process faults ----------------------------------------------------------------
    def _kill(self, ev: FaultEvent, p: Proc, pause_s: float = 0.0) -> None:
        ev.target = p.name
        took = self.stack.restart(p, self.startup_s, pause_s)
        ev.detail = f"{p.name} back on {p.url} after {took:.0f}s"

    def _kill_p(self, ev: FaultEvent) -> None:
        self._kill(ev, self.rng.choice(self.stack.prefills))

    def _kill_d(self, ev: FaultEvent) -> None:
        self._kill(ev, self.rng.choice(self.stack.decodes))

    def _kill_router(self, ev: FaultEvent) -> None:
        self._kill(ev, self.stack.router, pause_s=1.0)

    # -- hook faults -------------------------------------------------------------------
    def _hook(self, ev: FaultEvent) -> None:
        key = f"{ev.kind}-{len(self.events)}"
        self.plan.on(key, HOOKS[ev.kind])
        ev.detail = json.dumps(HOOKS[ev.kind])[:200]
        end = time.monotonic() + WINDOW_S
        if ev.kind.startswith("lease_"):
            time.sleep(1.0)  # every process has re-read the plan (faults.RELOAD_S)
            self._lease_calls(ev, end)
        if ev.kind == "read_hold":
            time.sleep(1.0)
            self._held_reads(ev, end)
        if ev.kind == "corrupt":
            time.sleep(1.0)
            self._corrupted_reads(ev, end)
        time.sleep(max(0.0, end - time.monotonic()))
        self.plan.off(key)

    def _held_reads(self, ev: FaultEvent, end: float) -> None:
        """Pull requests of its own until one READ was held: background traffic may finish
        no transfer in a window while engines restart on two busy cores (a CI run held
        none), and a window that held nothing tested nothing. At most one hold past the
        window's end."""
        rule = HOOKS["read_hold"][0]
        held0 = self._hits("done_hold")
        deadline = end + float(rule["s"])
        sent = 0
        while self._hits("done_hold") == held0 and time.monotonic() < deadline:
            base = self._base()
            self._send(ev, Item(base.endpoint, base.body, "pull", "read_hold", want=base.want))
            sent += 1
        ev.detail += f" own pulls={sent} held={self._hits('done_hold') - held0}"

    def _corrupted_reads(self, ev: FaultEvent, end: float) -> None:
        """Pull and push requests of its own, in turn, until a transfer's bytes were
        flipped (for the same reason as `_held_reads`) and the window is over; each must
        still get the right answer."""
        hit0 = self._hits("corrupt")
        sent = 0
        while time.monotonic() < end + 20.0 and (
                self._hits("corrupt") == hit0 or time.monotonic() < end):
            base = self._base()
            self._send(ev, Item(base.endpoint, base.body, ("pull", "push")[sent % 2], "corrupt",
                                want=base.want))
            sent += 1
        ev.detail += f" own requests={sent} flipped={self._hits('corrupt') - hit0}"

    def _lease_calls(self, ev: FaultEvent, end: float) -> None:
        """Lease-control traffic inside the window (background turns may not make any),
        sent again once the router is back until a lease call met the window's rules, at
        most `LEASE_GRACE_S` past its end: the seeded order can kill the router while the
        window's turns are in flight, and a CI run's lease window then met none (for the
        same reason as `_held_reads`: a window that met nothing tested nothing)."""
        hits0 = self._hits("lease_handle") + self._hits("lease_call")
        rounds = 0
        while True:
            router = self.restarting.get("router")
            if router is not None:  # a restart in progress: its requests would be refused
                router.join(timeout=max(0.0, end + LEASE_GRACE_S - time.monotonic()))
            self._lease_round(ev, f"{ev.kind}-{self.seed}-{len(self.events)}-{rounds}")
            rounds += 1
            met = self._hits("lease_handle") + self._hits("lease_call") - hits0
            if met or time.monotonic() > end + LEASE_GRACE_S:
                break
        ev.detail += f" rounds={rounds} lease hits={met}"

    def _lease_round(self, ev: FaultEvent, cid: str) -> None:
        """A streamed turn (the router fetches D's offer over the channel), a next turn
        (the old lease is released), a heartbeat (renewal) and the conversation's end."""
        conv = self.rng.choice(self.work.conversations)
        first, second = conv.turns[0], conv.turns[1]
        self._send(ev, Item(first.endpoint, {**first.body, "stream": True}, first.mode,
                            ev.kind, want=first.want, cid=cid))
        self._send(ev, Item(second.endpoint, second.body, second.mode, ev.kind,
                            want=second.want, cid=cid))
        url = f"{self.stack.router.url}/v1/kvferry/conversations/{cid}"
        for call in (lambda: self.client.post(url + "/heartbeat", timeout=30),
                     lambda: self.client.delete(url, timeout=30)):
            try:
                r = call()
                ev.detail += f" {r.request.method} {r.status_code}"
            except httpx.HTTPError as e:
                ev.detail += f" {e!r}"[:80]

    # -- request faults ----------------------------------------------------------------
    def _base(self) -> Item:
        """A non-streamed completions item with its reference (forged params ride on it)."""
        pool = [i for i in self.work.singles if i.endpoint == "completions" and not i.stream]
        return self.rng.choice(pool)

    def _send(self, ev: FaultEvent, item: Item) -> Outcome:
        out = send(self.stack.router.url, item, self.client)
        ev.outcomes.append(out)
        self.record(out)
        return out

    def _forged_params(self, ev: FaultEvent) -> None:
        base = self._base()
        p = self.rng.choice(self.stack.prefills)
        d = self.rng.choice(self.stack.decodes)
        n = len(base.body["prompt"])
        offer = {"do_remote_prefill": True, "remote_engine_id": "forged", "remote_host": "127.0.0.1",
                 "remote_port": p.side_port, "remote_block_ids": list(range(n // 128 + 1)),
                 "remote_request_id": "forged", "remote_num_tokens": n, "prompt_hash": "0" * 32,
                 "kvferry_sig": f"{self.rng.getrandbits(256):064x}"}
        lease = {"engine_id": "forged", "instance": "x", "host": "127.0.0.1",
                 "port": d.side_port, "lease_id": "forged", "block_ids": [0, 1], "block_size": 128,
                 "num_tokens": 256, "block_hashes": ["0", "1"], "expiry": time.time() + 60,
                 "kvferry_sig": f"{self.rng.getrandbits(256):064x}"}
        variants: list[tuple[str, str, Any]] = [
            ("client_params_to_router", "", offer),  # first: the router must drop them
            ("bad_signature", d.url, offer),
            ("malformed", d.url, {**offer, "remote_block_ids": "x", "remote_port": "y",
                                  "kvferry_sig": 5}),
            ("not_an_object", d.url, "garbage"),
            ("forged_lease_to_prefill", p.url, {"do_remote_decode": True, "transfer_id": "forged",
                                                "reuse": lease}),
            ("push_unknown_transfer", d.url, {"do_remote_prefill": True, "push": True,
                                              "transfer_id": f"forged-{self.rng.getrandbits(32)}",
                                              "remote_host": "127.0.0.1",
                                              "remote_port": p.side_port}),  # last: D waits
        ]
        ev.target = f"{p.name},{d.name}"
        for name, target, params in variants:
            body = {**base.body, "kv_transfer_params": params}
            self._send(ev, Item(base.endpoint, body, base.mode, f"forged_params:{name}", target,
                                base.want))

    def _oversize(self, ev: FaultEvent) -> None:
        model = self._base().body["model"]
        for mode in ("pull", "push"):
            toks = tokens(self.rng, MAX_MODEL_LEN + 64)
            self._send(ev, Item("completions", completion(model, toks, 4, False), mode,
                                "oversize", expect="error"))

    def _lease_expire_mid_read(self, ev: FaultEvent) -> None:
        """Turn 2 of a conversation while its lease is released and P's READ of the
        history is held past its deadline: P must recompute, never use those blocks."""
        convs = [c for c in self.work.conversations if c.turns[0].endpoint == "completions"]
        conv = self.rng.choice(convs)
        cid = f"expire-{self.seed}-{len(self.events)}"
        first, second = conv.turns[0], conv.turns[1]
        out = self._send(ev, Item(first.endpoint, first.body, "pull", "lease_expire_mid_read",
                                  want=first.want, cid=cid))
        if out.kind != "ok":
            ev.detail = f"turn 1 ended {out.kind}"
            return
        key = f"hold-{len(self.events)}"
        hold_s = self.stack.extra["reuse_read_timeout_s"] + 2.0
        tags = [p.name for p in self.stack.prefills]
        self.plan.on(key, [{"point": "done_hold", "action": "delay", "p": 1.0, "s": hold_s,
                            "tags": tags}])
        time.sleep(1.0)  # every engine has re-read the plan (faults.RELOAD_S)
        held0 = self._hits("done_hold", tags)
        th = threading.Thread(target=self._send, args=(ev, Item(
            second.endpoint, second.body, "pull", "lease_expire_mid_read", want=second.want,
            cid=cid)))
        th.start()
        # Release while P's READ is in flight: P asks D that the lease holds just before
        # it READs, so a release that came first would leave no READ to race (P would
        # recompute at its check). The hold hit says the READ has started and is held.
        deadline = time.monotonic() + hold_s + 10.0
        while (self._hits("done_hold", tags) == held0 and th.is_alive()
               and time.monotonic() < deadline):
            time.sleep(0.05)
        in_flight = self._hits("done_hold", tags) > held0
        try:
            r = self.client.delete(f"{self.stack.router.url}/v1/kvferry/conversations/{cid}",
                                   timeout=30)
            released = r.json().get("released")
        except (httpx.HTTPError, ValueError) as e:
            released = repr(e)
        th.join()
        self.plan.off(key)
        reuse = ev.outcomes[-1].headers.get("x-kvferry-reuse-reason", "")
        ev.detail = (f"released={released} with the READ in flight={in_flight}; "
                     f"turn 2 reuse_reason={reuse!r}")

    def _hits(self, point: str, tags: list[str] | None = None) -> int:
        """Hook hits at `point` so far in the processes tagged `tags` (None: in any)."""
        return sum(e.get("point") == point and (tags is None or e.get("tag") in tags)
                   for e in hook_events(self.plan.events))
