"""The decode engines' context length and vLLM version, learnt once from a decode engine's
``/v1/models`` (``max_model_len``) and ``/version``, in the background: the router is up
long before its engines (seconds against tens of seconds), and no request waits for this.
Until then (or with no engine answering) requests are checked without them.

Also the request body limit (413), sized from max_model_len unless configured.
"""

from __future__ import annotations

import asyncio
import logging
import re

import httpx

from ..settings import RouterSettings
from ..wire.validate import EngineLimits
from .upstreams import UpstreamPool

log = logging.getLogger(__name__)

RETRY_S = 2.0
BODY_BYTES_PER_TOKEN = 32
"""Bytes of request JSON per prompt token the default body limit allows: a token id is at
most 7 ("151935,"); text averages ~4 characters per token, and JSON escapes
(`\\uXXXX`, 6 bytes a character) at most multiply that by 6, so 32 covers a prompt of
max_model_len tokens written either way, with room for chat framing."""
BODY_OVERHEAD = 1 << 20
"""Plus this much for everything else in a body (sampling fields, tools, stop lists)."""
UNKNOWN_MODEL_LEN = 1 << 20
"""The context length the default limit assumes until the engines said theirs."""


def body_limit(settings: RouterSettings, limits: EngineLimits) -> int:
    """Bodies above this many bytes get 413 before they are read."""
    if settings.max_body_bytes is not None:
        return settings.max_body_bytes
    n = limits.max_model_len or UNKNOWN_MODEL_LEN
    return n * BODY_BYTES_PER_TOKEN + BODY_OVERHEAD


def parse_version(text: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


class LimitsWatch:
    """Holds the current `EngineLimits` (``known``); `run` fills it in."""

    def __init__(self, settings: RouterSettings) -> None:
        self.known = EngineLimits(max_model_len=settings.max_model_len)
        self._fixed = settings.max_model_len is not None

    async def fetch(self, client: httpx.AsyncClient, url: str, timeout: httpx.Timeout
                    ) -> bool:
        """Ask the engine at ``url``; True once it answered (an engine that is no vLLM may
        name no context length or version: then none is known)."""
        try:
            r = await client.get(url + "/v1/models", timeout=timeout)
            models = r.json() if r.status_code == 200 else None
            r = await client.get(url + "/version", timeout=timeout)
            version = r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return False
        if not isinstance(models, dict):
            return False
        lens = [m.get("max_model_len") for m in models.get("data", []) if isinstance(m, dict)]
        lens = [n for n in lens if isinstance(n, int) and n > 0]
        ver = parse_version(str(version.get("version", ""))) if isinstance(version, dict) \
            else None
        n = self.known.max_model_len if self._fixed else max(lens, default=None)
        self.known = EngineLimits(n, ver)
        log.info("decode engines: max_model_len %s, vLLM %s", self.known.max_model_len,
                 ".".join(map(str, ver)) if ver else "unknown")
        return True

    async def run(self, client: httpx.AsyncClient, pool: UpstreamPool,
                  timeout: httpx.Timeout) -> None:
        """Ask decode engines until one answers."""
        while True:
            for up in list(pool.upstreams):
                if await self.fetch(client, up.url, timeout):
                    return
            await asyncio.sleep(RETRY_S)
