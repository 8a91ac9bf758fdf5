"""Reading a request body with a size limit: a body above it gets 413 before it is read
in full or parsed (its Content-Length alone says so, or the bytes read so far)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from ..errors import error_body


class TooLarge(Exception):
    """The body is larger than the limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body larger than {limit} bytes")
        self.limit = limit

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(f"request body larger than {self.limit} bytes", 413,
                                       "invalid_request_error"), status_code=413)


async def read_capped(request: Request, limit: int) -> bytes:
    """The whole body, or `TooLarge` as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise TooLarge(limit)
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(limit)
        parts.append(chunk)
    return b"".join(parts)
