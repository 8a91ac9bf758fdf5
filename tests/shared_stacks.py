"""Engine pairs that several test modules start with the same configuration: started once.

An engine start costs ~30 s of CI per pair, so modules whose engines are configured alike
share one pair. A module marks itself ``pytestmark = pytest.mark.shared_stack(NAME)`` and
its module fixture takes ``shared(NAME, config, tmp_path_factory)``, then adds its own
router (stack.with_router). conftest.py runs the modules of one NAME one after another
and stops the pair after the last of them, so it never idles beside other modules'
engines (stack.py's CORE_RULE). Every module after the first gets the pair only once it
is back at baseline (`assert_baseline`); the modules' tests assert on deltas of the
engines' counters, so what earlier modules counted does not matter, and their prompts
differ, so what D's prefix cache kept from them is never hit.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import pytest
from stack import Stack, start_pd, tiny_model, wait_for

BASELINE_S = 30.0  # a lease released at a module's end frees its blocks within this


@dataclass(frozen=True)
class PairConfig:
    """What makes two engine pairs interchangeable: kvferry's settings and vLLM's args."""

    extra: dict[str, Any]
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()

    def key(self) -> str:
        return json.dumps([self.extra, self.prefill_args, self.decode_args], sort_keys=True)


@dataclass
class _Open:
    config: str
    stack: Stack
    exits: ExitStack
    handed: int = 0  # modules that took it


_OPEN: dict[str, _Open] = {}


PD = PairConfig({
    # pull (tests/test_e2e_pull.py): P holds unread KV 20 s, D waits 8 s for a READ
    "recv_timeout_s": 8, "handshake_timeout_s": 3, "send_timeout_s": 20,
    # push (tests/test_e2e_push.py, first: test_e2e_pull.py kills P last), layer-wise
    "push_hold_timeout_s": 8, "push_register_timeout_s": 8, "push_recv_timeout_s": 20,
    "push_quarantine_s": 1, "layerwise_push": True})
"""The pair "pd": default engine arguments, the pull and push modules' kvferry settings."""


def shared(name: str, config: PairConfig, tmp_path_factory: pytest.TempPathFactory) -> Stack:
    """The pair ``name`` (started now if it is not running), without a router; at baseline."""
    got = _OPEN.get(name)
    if got is None:
        exits = ExitStack()
        try:
            s = start_pd(exits, tiny_model(tmp_path_factory), tmp_path_factory.mktemp(f"logs-{name}"),
                         extra=config.extra, prefill_args=config.prefill_args,
                         decode_args=config.decode_args)
        except BaseException:
            exits.close()
            raise
        got = _OPEN[name] = _Open(config.key(), s, exits)
    assert got.config == config.key(), (
        f"modules sharing engine pair {name!r} configure it differently:\n"
        f"{got.config}\n{config.key()}")
    if got.handed:
        assert_baseline(got.stack)
    got.handed += 1
    return got.stack


def assert_baseline(s: Stack) -> None:
    """What a fresh pair shows: no request running or waiting, every KV block free (no
    lease, transfer or request holds one), both engines alive."""
    for e in (s.prefill, s.decode):
        assert e.child.alive(), f"shared {e.role} died in an earlier module"
        wait_for(lambda e=e: (e.metric("vllm:num_requests_running"),
                              e.metric("vllm:num_requests_waiting"), e.kv_usage()),
                 lambda v: v == (0, 0, 0), BASELINE_S,
                 f"shared {e.role} idle with every KV block free")


def close(name: str) -> None:
    """Stop the pair ``name`` (nothing if it is not running)."""
    got = _OPEN.pop(name, None)
    if got is not None:
        got.exits.close()


def close_all() -> None:
    for name in list(_OPEN):
        close(name)
