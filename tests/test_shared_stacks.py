"""The plumbing that lets test modules share an engine pair (shared_stacks.py, conftest.py):
its modules run back to back, the pair stops after the last of them, and a module after
the first gets it only at baseline. Fakes stand in for the engines (no vLLM starts here)."""

from __future__ import annotations

import importlib.util
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import shared_stacks
from shared_stacks import PairConfig

# tests/conftest.py by its path: in a whole run the module named `conftest` can be another
# directory's (tests/gpu/conftest.py), which has none of these hooks.
_spec = importlib.util.spec_from_file_location("kvferry_tests_conftest",
                                               Path(__file__).with_name("conftest.py"))
assert _spec and _spec.loader
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)


@dataclass
class FakeItem:
    """A collected test: its module name and, if any, its shared_stack mark."""

    name: str
    group: str | None = None
    last: bool = False

    def get_closest_marker(self, name: str) -> Any:
        if name == "shared_stack" and self.group:
            return pytest.mark.shared_stack(self.group, last=self.last).mark
        return None


def test_modules_of_one_pair_run_back_to_back_in_their_own_order() -> None:
    items = [FakeItem("a1"), FakeItem("reuse1", "p"), FakeItem("reuse2", "p"), FakeItem("tp1"),
             FakeItem("other1", "q"), FakeItem("turns1", "p"), FakeItem("turns2", "p"),
             FakeItem("z1")]
    conftest.pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [i.name for i in items] == ["a1", "reuse1", "reuse2", "turns1", "turns2", "tp1",
                                       "other1", "z1"]


def test_a_module_marked_last_runs_after_the_pairs_others() -> None:
    """test_e2e_pull.py kills P in its last test: test_e2e_push.py, after it by name, runs
    first on the pair they share."""
    items = [FakeItem("a1"), FakeItem("pull1", "pd", last=True),
             FakeItem("pull2", "pd", last=True), FakeItem("push1", "pd"),
             FakeItem("push2", "pd"), FakeItem("z1")]
    conftest.pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [i.name for i in items] == ["a1", "push1", "push2", "pull1", "pull2", "z1"]


def teardown(item: FakeItem, nextitem: FakeItem | None) -> None:
    hook = conftest.pytest_runtest_teardown(item, nextitem)  # type: ignore[arg-type]
    next(hook)
    with pytest.raises(StopIteration):
        next(hook)


def test_the_pair_stops_after_its_last_module_and_only_then(monkeypatch) -> None:
    stopped: list[str] = []
    exits = ExitStack()
    exits.callback(stopped.append, "p")
    monkeypatch.setattr(shared_stacks, "_OPEN", {"p": shared_stacks._Open("cfg", None, exits)})  # type: ignore[arg-type]
    teardown(FakeItem("reuse2", "p"), FakeItem("turns1", "p"))
    assert stopped == []  # the next module shares it
    teardown(FakeItem("turns2", "p"), FakeItem("tp1"))
    assert stopped == ["p"] and shared_stacks._OPEN == {}


@dataclass
class FakeEngine:
    role: str
    values: dict[str, float] = field(default_factory=dict)

    @property
    def child(self) -> Any:
        return self

    def alive(self) -> bool:
        return True

    def metric(self, name: str) -> float:
        return self.values.get(name, 0.0)

    def kv_usage(self) -> float:
        return self.values.get("vllm:kv_cache_usage_perc", 0.0)


@dataclass
class FakeStack:
    prefill: FakeEngine
    decode: FakeEngine


@pytest.mark.parametrize("left", ["vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                                  "vllm:num_requests_waiting"])
def test_a_pair_not_back_at_baseline_is_not_handed_on(monkeypatch, left: str) -> None:
    monkeypatch.setattr(shared_stacks, "BASELINE_S", 0.3)
    idle = FakeStack(FakeEngine("prefill"), FakeEngine("decode"))
    shared_stacks.assert_baseline(idle)  # type: ignore[arg-type]
    busy = FakeStack(FakeEngine("prefill"), FakeEngine("decode", {left: 0.01}))
    with pytest.raises(AssertionError, match="shared decode idle with every KV block free"):
        shared_stacks.assert_baseline(busy)  # type: ignore[arg-type]


def test_the_second_module_gets_the_pair_only_through_the_baseline_check(monkeypatch) -> None:
    checked: list[Any] = []
    monkeypatch.setattr(shared_stacks, "assert_baseline", checked.append)
    cfg = PairConfig({"handshake_timeout_s": 3}, ("--no-enable-prefix-caching",))
    pair = object()
    monkeypatch.setattr(shared_stacks, "_OPEN",
                        {"p": shared_stacks._Open(cfg.key(), pair, ExitStack())})  # type: ignore[arg-type]
    assert shared_stacks.shared("p", cfg, None) is pair  # type: ignore[arg-type]
    assert checked == []  # the first module: started for it
    assert shared_stacks.shared("p", cfg, None) is pair  # type: ignore[arg-type]
    assert checked == [pair]
    other = PairConfig({"handshake_timeout_s": 5}, ("--no-enable-prefix-caching",))
    with pytest.raises(AssertionError, match="configure it differently"):
        shared_stacks.shared("p", other, None)  # type: ignore[arg-type]
