"""CI's wiring: the quick start's setup never asks for sudo, the test command installs what
only the tests need, and every run bounds each test and prints the slowest ones."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CI = ROOT / ".ci"
TEST_ONLY = ("redis-server", "autoconf", "automake", "libtool", "libhwloc15")


def user_part(setup: str) -> str:
    """.ci/setup's commands (comments dropped) before its `--tests` branch: what the quick
    start runs."""
    head = setup.split('if [ "$TESTS" = 1 ]', 1)[0]
    return "\n".join(ln.split("#", 1)[0] for ln in head.splitlines())


def test_quick_start_setup_asks_for_no_sudo_or_apt() -> None:
    setup = (CI / "setup").read_text()
    assert 'if [ "$TESTS" = 1 ]' in setup and "bash .ci/setup-tests" in setup
    user = user_part(setup)
    for word in ("sudo", "apt-get", *TEST_ONLY):
        assert word not in user, word


def test_ci_run_installs_the_test_only_parts_first() -> None:
    run = (CI / "run").read_text()
    setup_at = run.index("bash .ci/setup --tests")
    assert setup_at < run.index("bash .ci/test")
    tests = (CI / "setup-tests").read_text()
    for pkg in TEST_ONLY:
        assert re.search(rf"^\s*apt_need {re.escape(pkg)} ", tests, flags=re.M), pkg
    assert "fetch_vllm_sources.py" in tests and "build_libfabric.py" in tests


def test_ci_run_exits_with_pytests_code() -> None:
    run = (CI / "run").read_text()
    assert "set -e" not in run.replace("set -uo pipefail", "")  # pytest's code is read, not lost
    assert re.search(r"^rc=\$\?$", run, flags=re.M) and run.rstrip().endswith("exit $rc")
    for code in range(6):  # every pytest.ExitCode is explained
        assert re.search(rf"^\s*{code}\) echo", run, flags=re.M), code


def test_every_run_bounds_each_test_and_prints_the_slowest(pytestconfig: pytest.Config) -> None:
    assert "--durations=20" in pytestconfig.getini("addopts")
    assert float(pytestconfig.getini("timeout")) >= 300
    assert pytestconfig.getini("timeout_method") == "signal"  # a hang fails one test, not the run


def test_ci_test_runs_every_test_once() -> None:
    """.ci/test's three runs (timing alone, then engine beside unit) select every test
    exactly once between them, and the parallel ones use port ranges that do not overlap."""
    text = (CI / "test").read_text()
    marks = re.findall(r'-m "([^"]+)"|-m (engine)\b', text)
    exprs = sorted(a or b for a, b in marks)
    assert exprs == sorted(["timing and not engine", "engine", "not engine and not timing"])
    for engine in (False, True):  # the three expressions partition every combination
        for timing in (False, True):
            hits = [e for e in exprs
                    if eval(e, {}, {"engine": engine, "timing": timing})]  # noqa: S307
            assert len(hits) == 1, (engine, timing, hits)
    ranges = [tuple(map(int, r.split("-"))) for r in re.findall(r"KVFERRY_PORT_RANGE=(\d+-\d+)", text)]
    assert len(ranges) == 2 and (ranges[0][1] <= ranges[1][0] or ranges[1][1] <= ranges[0][0])


def test_the_chaos_test_has_room_for_its_documented_bound() -> None:
    """test_chaos.py: under 8 minutes on two cores; its marker must leave room for that."""
    text = (ROOT / "tests" / "test_chaos.py").read_text()
    (bound,) = re.findall(r"@pytest\.mark\.timeout\((\d+)\)\ndef test_chaos_books_balance", text)
    assert int(bound) >= 2 * 8 * 60
