"""Who the request being served is for: its tenant's key and whether it is an operator.

A context variable (`CALLER`), set once where the request enters (`api.auth`), read by
the steps below instead of being passed through every call. It lives with the
conversations because the tenant of every conversation entry is derived from it."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from .registry import api_key_from


@dataclass(frozen=True)
class Caller:
    """The request's caller: an operator (token matched), and its API key's id."""

    operator: bool = False
    key_id: str | None = None


ANYONE = Caller()  # frozen: safe as the context variable's default
CALLER: ContextVar[Caller] = ContextVar("kvferry_caller", default=ANYONE)


def caller_key(headers: Any) -> str | None:
    """What the tenant is derived from: the router key's id when keys are on, else the
    client's API key as sent (engines check it)."""
    kid = CALLER.get().key_id
    return f"key-id:{kid}" if kid is not None else api_key_from(headers)


def is_operator() -> bool:
    return CALLER.get().operator
