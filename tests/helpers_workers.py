"""Two in-process TransferWorkers over real NIXL, DRAM tensors: the harness of the
worker tests (test_worker, test_push_worker, test_stats, test_early_push, test_read_release).

P and D each have their own CpuBackend layout, NIXL agent and side-channel port; offers are
real signed offers from TransferScheduler, so this is the pull and push path minus vLLM.
Test modules take the fixture as ``engines = helpers_workers.engines``.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers_http import free_port

from kvferry.connectors.config import ConnectorConfig
from kvferry.connectors.memory.backends import CpuBackend
from kvferry.connectors.protocol.params import SECRET_ENV
from kvferry.connectors.protocol.step import StepMeta
from kvferry.connectors.scheduling.scheduler import TransferScheduler
from kvferry.connectors.transfer import faults
from kvferry.connectors.transfer.results import Results
from kvferry.connectors.transfer.worker import TransferWorker

N, BS = 16, 4
PROMPT = list(range(1, 23))  # 22 tokens -> 6 blocks


def caches(seed: int | None) -> dict[str, torch.Tensor]:
    if seed is None:
        return {"l0": torch.zeros(2, N, BS, 2, 8), "l1": torch.zeros(N, 2, BS, 8)}
    g = torch.Generator().manual_seed(seed)
    return {"l0": torch.randn(2, N, BS, 2, 8, generator=g), "l1": torch.randn(N, 2, BS, 8, generator=g)}


def blocks_of(c: dict[str, torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    return [c["l0"][:, ids], c["l1"][ids]]


class Engine:
    """One side (P or D): its KV caches, TransferWorker, TransferScheduler and the results
    the worker reported so far."""

    def __init__(self, role: str, seed: int | None, **cfg):
        self.engine_id = f"{role}-{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.cfg = ConnectorConfig(side_channel_port=self.port, **cfg)
        self.kv = caches(seed)
        self.worker = TransferWorker(self.cfg, self.engine_id, 0,
                                     CpuBackend().describe(self.kv, N, BS))
        self.sched = TransferScheduler(self.engine_id, "127.0.0.1", self.port, BS)
        self.acc = Results()

    def collect(self, until: Callable[[Results], bool], timeout: float) -> Results:
        """The results so far, once ``until`` holds for them or ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        while True:
            r = self.worker.results()
            self.acc.sent |= r.sent
            self.acc.recvd |= r.recvd
            self.acc.bad_blocks |= r.bad_blocks
            if until(self.acc) or time.monotonic() >= deadline:
                return self.acc
            time.sleep(0.005)


@pytest.fixture
def engines(monkeypatch):
    """``engines(role, seed=None, **cfg)`` makes an Engine; all are closed after the test."""
    monkeypatch.setenv(SECRET_ENV, "worker-test-secret")
    made: list[Engine] = []

    def make(role: str, seed: int | None = None, **cfg) -> Engine:
        # Generous: a handshake on a busy CI core took over a second (D recomputed); tests
        # of a dead or silent peer pass their own short timeout.
        cfg.setdefault("handshake_timeout_s", 15.0)
        e = Engine(role, seed, **cfg)
        made.append(e)
        return e

    yield make
    for e in made:
        e.worker.close()


def p_finish(p: Engine, req: str, blocks: list[int], prompt=PROMPT) -> dict:
    """P's request finished: its signed pull offer."""
    keep, offer = p.sched.finished(req, True, blocks, {"do_remote_decode": True}, prompt)
    assert keep
    return offer


def d_task(d: Engine, req: str, offer: dict, local: list[int], hit: int = 0, prompt=PROMPT) -> StepMeta:
    """D takes ``offer`` into ``local`` blocks (``hit`` tokens cached): the step's READ."""
    count, is_async = d.sched.matched_tokens(req, prompt, offer, hit)
    assert d.sched.rejection(req) is None
    d.sched.after_alloc(req, local, count if is_async else 0)
    return d.sched.take_meta()


P_BLOCKS = [2, 3, 4, 9, 10, 15]
D_BLOCKS = [0, 1, 2, 3, 7, 8]


# -- push: D registers its blocks, P WRITEs into them ------------------------------------
def d_register(d: Engine, p: Engine, req: str, tid: str, local: list[int]):
    """D registers ``local`` blocks with P for push transfer ``tid``."""
    params = {"do_remote_prefill": True, "push": True, "transfer_id": tid,
              "remote_host": "127.0.0.1", "remote_port": p.port}
    count, is_async = d.sched.matched_tokens(req, PROMPT, params, 0)
    assert (count, is_async) == (len(PROMPT), True)
    d.sched.after_alloc(req, local, count)
    meta = d.sched.take_meta()
    assert len(meta.register) == 1
    d.worker.submit(meta)


def p_done(p: Engine, req: str, tid: str, blocks: list[int]) -> None:
    """P's push request finished: its worker WRITEs ``blocks`` once D registered."""
    keep, out = p.sched.finished(req, True, blocks,
                                 {"do_remote_decode": True, "push": True, "transfer_id": tid},
                                 PROMPT)
    assert keep and out["transfer_id"] == tid
    p.worker.submit(p.sched.take_meta())


def written(d: Engine, p: Engine, d_blocks: list[int], p_blocks: list[int]) -> bool:
    """D's ``d_blocks`` hold exactly P's ``p_blocks``."""
    return all(torch.equal(a, b) for a, b in zip(blocks_of(d.kv, d_blocks),
                                                 blocks_of(p.kv, p_blocks), strict=True))


def wait_ranks(workers: list[TransferWorker], accs: list[Results], req: str, what: str,
               timeout: float) -> list[Results]:
    """Accumulate each TP rank's results into ``accs`` until ``req`` is in every rank's
    ``what`` (sent / recvd) or ``timeout`` passed; the accumulated results."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for w, acc in zip(workers, accs, strict=True):
            r = w.results()
            acc.sent |= r.sent
            acc.recvd |= r.recvd
            acc.bad_blocks |= r.bad_blocks
        if all(req in getattr(a, what) for a in accs):
            break
        time.sleep(0.005)
    return accs


def failures(*es: Engine) -> list[tuple[str, str, str]]:
    """The failure events (counter, key, why) ``es`` recorded: an assertion's message."""
    return [(e.engine_id, ev.name, f"{ev.key}: {ev.detail}") for e in es
            for ev in e.worker.stats.snapshot().events if "fail" in ev.name or ev.detail]


def settle(e: Engine, seconds: float = 0.5) -> Results:
    """What ``e`` reports within ``seconds`` (for checks that something did NOT happen)."""
    return e.collect(lambda r: False, seconds)


def install_fault_plan(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                       tag: str) -> Callable[[list[dict]], Path]:
    """The fault hooks (connectors/transfer/faults.py) on, reading a plan file under
    ``tmp_path`` at once; returns ``rules(rs)``, which writes the plan and returns the
    events dir (one line per hit). ``tag`` seeds the plan's random choices."""
    path, events = tmp_path / "plan.json", tmp_path / "events"
    monkeypatch.setattr(faults, "RELOAD_S", 0.0)
    monkeypatch.setattr(faults, "ACTIVE", True)
    monkeypatch.setattr(faults, "_PLAN", faults._Plan(str(path), tag))

    def rules(rs: list[dict]) -> Path:
        path.write_text(json.dumps({"seed": 1, "events": str(events), "rules": rs}))
        os.utime(path, (time.time() + 1, time.time() + 1))
        return events

    return rules
