"""OpenAI-style error bodies and the exception that carries them to the HTTP layer.

Every failure names the leg (prefill or decode) and, in the router's log, the upstream,
so an operator can tell which engine to look at; clients get the message without engine
addresses (`RouterError.client_message`).
"""

from __future__ import annotations

import re
from typing import Any

import httpx
from fastapi.responses import JSONResponse

_URL = re.compile(
    r"(?:https?|tcp)://[^\s,;)'\"]+"  # URLs
    r"|\[[0-9a-fA-F:]+\](?::\d+)?"  # [v6]:port
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"  # v4[:port], as HTTP clients word failures
    r"|\b[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+:\d{1,5}\b")  # host.name:port
"""Engine addresses in an error message, as a client must not see them."""


def error_body(message: str, status: int, err_type: str, code: str | None = None) -> dict[str, Any]:
    """The `{"error": {...}}` shape OpenAI clients know how to display."""
    return {"error": {"message": message, "type": err_type, "param": None, "code": code or status}}


class RouterError(Exception):
    """A request failure already mapped to an HTTP status and an OpenAI error body."""

    def __init__(self, status: int, message: str, err_type: str, leg: str, kind: str,
                 upstream: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.leg = leg
        self.kind = kind
        self.upstream = upstream  # the engine that failed, where one did

    @property
    def client_message(self) -> str:
        """The message without engine addresses (logs keep them; clients never see where
        the engines are)."""
        return _URL.sub("<engine>", self.message)

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        """JSON response for the client."""
        body = error_body(self.client_message, self.status, self.err_type)
        return JSONResponse(body, status_code=self.status, headers=headers)


def from_transport(exc: httpx.HTTPError, leg: str, url: str) -> RouterError:
    """Map an httpx failure: timeouts -> 504, anything else on the wire -> 502."""
    if isinstance(exc, httpx.ConnectTimeout):
        return RouterError(504, f"{leg} upstream {url} connect timeout", "upstream_timeout",
                           leg, "connect_timeout", url)
    if isinstance(exc, httpx.TimeoutException):
        return RouterError(504, f"{leg} upstream {url} timed out ({type(exc).__name__})",
                           "upstream_timeout", leg, "timeout", url)
    if isinstance(exc, httpx.ConnectError):
        return RouterError(502, f"{leg} upstream {url} unreachable: {exc}",
                           "upstream_unavailable", leg, "connect", url)
    return RouterError(502, f"{leg} upstream {url} failed: {type(exc).__name__}: {exc}",
                       "upstream_error", leg, "transport", url)


def from_status(status: int, text: str, leg: str, url: str) -> RouterError:
    """Map an upstream 5xx to 502, keeping the start of its message for the client."""
    snippet = text.strip().replace("\n", " ")[:500]
    return RouterError(502, f"{leg} upstream {url} returned HTTP {status}: {snippet}",
                       "upstream_error", leg, f"http_{status}", url)


NOT_SENT = ("connect", "connect_timeout")
BROKE = "transport"
"""The `from_transport` kind of a leg whose engine took the request, then dropped the
connection without an answer (it died, most likely): a JSON answer may be asked afresh
of another pair, since the client has seen nothing."""
"""`from_transport` kinds of a leg whose connection never opened: the engine got no byte
of the request, so the same leg may go to another engine as it is."""


def never_sent(err: RouterError) -> bool:
    """The leg failed before its connection opened (see `NOT_SENT`)."""
    return err.kind in NOT_SENT
