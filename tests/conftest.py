"""Fixtures shared by the test modules, and engine log tails on engine-test failures."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import httpx
import pytest


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
    """A plain HTTP client for talking to routers started in the tests."""
    with httpx.Client(trust_env=False, timeout=20) as c:
        yield c
