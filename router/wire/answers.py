"""Response shaping: what an engine's answer looks like once it reaches the client (no
engine-owned field, the router's own fields added)."""

from __future__ import annotations

import json
from typing import Any

import httpx
from starlette.responses import Response

from . import bodies


def passthrough(resp: httpx.Response, headers: dict[str, str]) -> Response:
    """Return an upstream's non-2xx answer (status, body, content type) without
    engine-owned fields."""
    return Response(
        finish_json(resp.content, {}),
        status_code=resp.status_code,
        media_type=resp.headers.get("content-type", "application/json"),
        headers=headers,
    )


def finish_json(data: bytes, extra: dict[str, Any]) -> bytes:
    """Drop engine-owned fields (D's block locations and lease) and add `extra` fields."""
    if not extra and not any(f'"{k}"'.encode() in data for k in bodies.ENGINE_FIELDS):
        return data
    try:
        obj = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return data
    if not isinstance(obj, dict):
        return data
    bodies.scrub_engine_fields(obj)
    obj.update(extra)
    return json.dumps(obj).encode()


def kv_params_of(data: bytes) -> dict[str, Any] | None:
    """The top-level kv_transfer_params of a JSON answer, or None."""
    try:
        return bodies.extract_kv_params(json.loads(data))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def ms_str(secs: float) -> str:
    return f"{secs * 1000.0:.3f}"
