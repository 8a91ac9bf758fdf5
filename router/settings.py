"""Router configuration.

One pydantic model so the same object can be built from CLI flags, a JSON file or tests,
and is validated once at start-up rather than on every request.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

Mode = Literal["pull", "push"]
MODES: tuple[str, ...] = ("pull", "push")


class RouterSettings(BaseModel):
    """Upstreams, transfer mode and timeouts for one router process."""

    prefill_urls: list[str] = Field(min_length=1, description="Base URLs of prefill engines.")
    decode_urls: list[str] = Field(min_length=1, description="Base URLs of decode engines.")
    mode: Mode = Field("pull", description="Default transfer mode when a request names none.")
    push_enabled: bool = Field(
        False, description="Accept mode=push; off until the push connector is wired."
    )
    connect_timeout_s: float = Field(3.0, gt=0, description="TCP connect timeout per upstream call.")
    prefill_timeout_s: float = Field(
        300.0, gt=0, description="Read timeout for the prefill leg (whole prompt compute)."
    )
    decode_timeout_s: float = Field(
        300.0, gt=0, description="Read timeout for the decode leg, per received chunk."
    )
    max_connections: int = Field(1024, gt=0, description="httpx pool size shared by all upstreams.")

    @field_validator("prefill_urls", "decode_urls")
    @classmethod
    def _normalise(cls, urls: list[str]) -> list[str]:
        """Accept comma-separated entries and drop trailing slashes so paths join cleanly."""
        out: list[str] = []
        for entry in urls:
            for url in entry.split(","):
                url = url.strip().rstrip("/")
                if not url:
                    continue
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"upstream URL must start with http:// or https://: {url!r}")
                out.append(url)
        if not out:
            raise ValueError("at least one upstream URL is required")
        return out
