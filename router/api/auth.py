"""Who is asking: router API keys (optional) and the operator token.

API keys (``api_keys_file``): a JSON object ``{"<key id>": "<secret key>", ...}``, re-read
when the file changes, so keys rotate without a restart (a Kubernetes Secret mounted as a
file changes in place). With keys on, every API call needs ``Authorization: Bearer <key>``
(or ``x-api-key``) naming one of them: anything else is 401 before any engine work, and
the conversation tenant is the key's id (a rotated key keeps its tenant's conversations).

Operator token (``operator_token`` / ``operator_token_file`` / ``KVFERRY_OPERATOR_TOKEN``):
a request carrying ``x-kvferry-operator-token: <token>`` sees engine identity (which P and
D served it, the transfer id, P's time), /health's engine list and may ask
``/health?deep=true``. Without it a client sees what OpenAI's API and kvferry's reuse
headers say, nothing of where its KV lives.

The caller of the request being served is a context variable (`CALLER`), set once where
the request enters; the steps below read it instead of passing it through every call.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse

from ..conversations.caller import CALLER, Caller
from ..conversations.registry import api_key_from
from ..errors import error_body
from ..wire.headers import OPERATOR_HEADERS, OPERATOR_TOKEN_ENV, OPERATOR_TOKEN_HEADER

log = logging.getLogger(__name__)

RELOAD_CHECK_S = 1.0
"""How often (at most) the keys file's modification time is looked at."""


def redact(headers: Any) -> None:
    """Remove engine identity from a response's headers unless the caller is an operator."""
    if CALLER.get().operator:
        return
    for name in OPERATOR_HEADERS:
        if name in headers:
            del headers[name]


def unauthorized(message: str) -> JSONResponse:
    return JSONResponse(error_body(message, 401, "authentication_error"), status_code=401,
                        headers={"www-authenticate": "Bearer"})


class ApiKeys:
    """Key id by secret key, from a JSON file re-read when its mtime or size changes. A
    file that cannot be read or parsed keeps the last good keys (logged once per change):
    a botched rotation must not lock every client out, nor let anyone in."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._by_key: dict[str, str] = {}
        self._stamp: tuple[float, int] | None = None
        self._checked = 0.0
        if not self._load():
            raise ValueError(f"API keys file {path}: no usable keys (JSON object of "
                             '{"key id": "key"})')

    def _load(self) -> bool:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime, st.st_size)
            if stamp == self._stamp:
                return True
            raw = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            log.warning("API keys file %s unreadable (%s); keeping the previous keys",
                        self.path, e)
            return False
        if not isinstance(raw, dict) or not raw or not all(
                isinstance(k, str) and isinstance(v, str) and v for k, v in raw.items()):
            log.warning("API keys file %s is not a JSON object of key id -> key; keeping "
                        "the previous keys", self.path)
            return False
        self._by_key = {v: k for k, v in raw.items()}
        self._stamp = stamp
        log.info("API keys: %d loaded from %s", len(self._by_key), self.path)
        return True

    def key_id(self, key: str | None) -> str | None:
        """The id of ``key``, or None when it is no valid key (now)."""
        now = time.monotonic()
        if now - self._checked >= RELOAD_CHECK_S:
            self._checked = now
            self._load()
        if not key:
            return None
        for known, kid in self._by_key.items():  # constant time per key, as hmac advises
            if hmac.compare_digest(known.encode(), key.encode()):
                return kid
        return None


def operator_token(token: str | None, token_file: str | None) -> str | None:
    """The configured operator token: the setting, else the file's first line, else the
    environment; None (nobody is an operator) when none is set."""
    if token:
        return token
    if token_file:
        value = Path(token_file).read_text().strip()
        if not value:
            raise ValueError(f"operator token file {token_file} is empty")
        return value
    return os.environ.get(OPERATOR_TOKEN_ENV) or None


class Gate:
    """Checks one request's credentials and sets `CALLER` for it."""

    def __init__(self, keys: ApiKeys | None, token: str | None) -> None:
        self.keys = keys
        self._token = token.encode() if token else None

    def admit(self, headers: Mapping[str, str], need_key: bool = True) -> JSONResponse | None:
        """Set the caller; a 401 response when API keys are on and ``headers`` carry no
        valid one (``need_key`` False: /health and /metrics, which never need one)."""
        sent = headers.get(OPERATOR_TOKEN_HEADER)
        operator = bool(self._token and sent and hmac.compare_digest(sent.encode(),
                                                                     self._token))
        kid = None
        if self.keys is not None and need_key:
            kid = self.keys.key_id(api_key_from(headers))
            if kid is None:
                CALLER.set(Caller(operator))
                return unauthorized("missing or invalid API key")
        CALLER.set(Caller(operator, kid))
        return None
