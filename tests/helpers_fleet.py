"""Shared by the router fleet tests: the fleet secret and request bits, a fake D whose
answers carry real signed lease offers (a real LeaseKeeper behind a real lease-control
server), and metric readers."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from helpers_http import FakeEngine, free_port, lease_reason

from kvferry.connectors.scheduling.lease_keeper import LeaseKeeper
from kvferry.connectors.transfer.lease_control import ControlServer

KEY = b"fleet-secret"
TOKENS = list(range(100, 120))
AUTH = {"authorization": "Bearer key-A"}
P_PARAMS = {"do_remote_prefill": True, "remote_block_ids": [3], "remote_engine_id": "p0",
            "remote_host": "127.0.0.1", "remote_port": 5600}

def metric(app: FastAPI, name: str, **labels: str) -> float:
    return app.state.metrics.registry.get_sample_value(name, labels) or 0.0


def metric_sum(app: FastAPI, name: str) -> float:
    total = 0.0
    for fam in app.state.metrics.registry.collect():
        for s in fam.samples:
            if s.name == name:
                total += s.value
    return total


class LeasingD:
    """A fake D whose JSON answers carry a real, signed lease offer for the asked lease."""

    def __init__(self, name: str = "d0") -> None:
        self.keeper = LeaseKeeper(f"{name}-engine", "boot-1", "127.0.0.1", 5800, 4, ttl=100.0,
                                  free_grace=0.0)
        self.control_port = free_port()
        self.server = ControlServer(self.keeper, "127.0.0.1", self.control_port)
        self.engine = FakeEngine(name, script=self._answer)
        self._n = 0

    def _answer(self, body: dict[str, Any], chat: bool) -> tuple[str, list[bytes]]:
        self._n += 1
        lease = (body.get("kv_transfer_params") or {}).get("lease")
        offer = self.keeper.grant(f"req-{self._n}", lease, [1, 2, 3, 4, 5], TOKENS, len(TOKENS))
        out = {"id": "d-1", "object": "text_completion", "model": "tiny",
               "choices": [{"index": 0, "text": "answer", "finish_reason": "stop"}],
               "kv_transfer_params": {"lease": offer}}
        return json.dumps(out), []

    def reason(self, lease_id: str) -> str | None:
        return lease_reason(self.keeper, lease_id)


def reuse_of(p: FakeEngine, i: int = -1) -> dict[str, Any] | None:
    return p.received[i]["kv_transfer_params"].get("reuse")
