"""README's main job, end to end: `kvferry run` starts real vLLM CPU engines and the
router, and its multi-turn demo must move KV both ways (P -> D READs, and D -> P history
reads on later turns), as the engines' counters say (`kvferry run` prints them after the
demo). It caught a router started without the deployment secret, whose lease requests D
refused, so that no turn ever reused D's KV."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from helpers_http import free_port

pytestmark = pytest.mark.engine


def test_kvferry_run_moves_kv_both_ways(tmp_path):
    ports = [str(free_port()) for _ in range(3)]
    argv = [sys.executable, "-m", "kvferry.scripts.cli", "run", "--prefill-port", ports[0],
            "--decode-port", ports[1], "--router-port", ports[2]]
    r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "demo ok" in out and "all processes stopped" in out
    reused = [int(n) for n in re.findall(r"(\d+) history tokens reused", out)]
    assert len(reused) == 4 and reused[0] == 0, out[-3000:]
    assert any(n > 0 for n in reused[1:]), out[-3000:]  # D -> P: history read back
    # Every later turn found the previous one's lease: it reused, or says why not. A turn
    # with no report had no entry (CI saw turn 2 sent before turn 1's stream was recorded).
    reports = re.findall(r"(\d+) history tokens reused( \((?!P http)[^)]*\))?", out)
    assert all(int(n) > 0 or why for n, why in reports[1:]), out[-3000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("transfers ")]
    moved = json.loads(line.removeprefix("transfers "))
    turns = len(reports)
    assert moved["decode"].get("reads_done") == turns, line  # P -> D, every turn
    assert moved["prefill"].get("reuse_reads_done", 0) == sum(n > 0 for n in reused), line
    for role in ("prefill", "decode"):  # nothing fell back or failed
        assert not {k for k in moved[role] if k.endswith("_failed") or k in (
            "recomputes", "sends_expired", "thread_errors", "unavailable")}, line
