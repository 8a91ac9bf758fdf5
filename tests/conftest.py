"""Fixtures shared by the router test modules (real HTTP against fake engines)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    """A plain HTTP client for talking to routers started in the tests."""
    with httpx.Client(trust_env=False, timeout=20) as c:
        yield c
