"""Where the tests find other vLLM versions' Python sources (fetched by .ci/setup-tests)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = "KVFERRY_VLLM_SOURCES"


def sources_root() -> Path:
    return Path(os.environ.get(ENV) or ROOT / ".venv" / "vllm-src")


def source_dir(version: str) -> Path:
    """The folder holding `vllm/` of `version`; fails (never skips) when absent, since
    .ci/setup-tests fetches every version the tests use."""
    d = sources_root() / version
    if not (d / "vllm" / "__init__.py").is_file():
        raise FileNotFoundError(f"vLLM {version} sources not found in {d}; run bash .ci/setup --tests")
    return d
