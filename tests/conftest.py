"""Fixtures shared by the test modules, and engine log tails on engine-test failures."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import httpx
import pytest
from helpers_http import OPERATOR


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ANN001, ANN201
    """A failing engine test's report carries the live engines' log tails."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and "stack" in sys.modules:
        from stack import engine_log_tails

        tails = engine_log_tails()
        if tails:
            report.sections.append(("engine logs", tails))


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    """An HTTP client for routers started in the tests, as their operator (it sees which
    engines served a request); `anon_client` sees what any client sees."""
    with httpx.Client(trust_env=False, timeout=20, headers=OPERATOR) as c:
        yield c


@pytest.fixture
def anon_client() -> Iterator[httpx.Client]:
    """An HTTP client without the operator token."""
    with httpx.Client(trust_env=False, timeout=20) as c:
        yield c


# -- engine pairs shared by modules (shared_stacks.py) ------------------------------------
def shared_group(item: pytest.Item) -> str | None:
    """The shared engine pair a test's module uses, if any."""
    mark = item.get_closest_marker("shared_stack")
    return str(mark.args[0]) if mark else None


def _runs_last(item: pytest.Item) -> bool:
    mark = item.get_closest_marker("shared_stack")
    return bool(mark and mark.kwargs.get("last"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "shared_stack(name, last=False): the module's engines "
                            "are the session's shared pair `name` (tests/shared_stacks.py); "
                            "`last`: it runs after the pair's other modules (it kills one)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules sharing an engine pair run one after another, from where the first of
    them was (each module's own order is kept; a module marked ``last`` goes after the rest,
    since it ends the pair)."""
    out: list[pytest.Item] = []
    placed: set[str] = set()
    for item in items:
        name = shared_group(item)
        if name is None:
            out.append(item)
        elif name not in placed:
            placed.add(name)
            group = [i for i in items if shared_group(i) == name]
            out += sorted(group, key=_runs_last)  # stable: each module's order is kept
    items[:] = out


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):  # noqa: ANN201
    """After the last test of a shared pair's modules (theirs torn down): stop the pair."""
    yield
    if "shared_stacks" in sys.modules:
        from shared_stacks import close

        name = shared_group(item)
        if name is not None and (nextitem is None or shared_group(nextitem) != name):
            close(name)


def pytest_sessionfinish() -> None:
    if "shared_stacks" in sys.modules:
        from shared_stacks import close_all

        close_all()
