"""README's main job, end to end: `kvferry run` starts real vLLM CPU engines and the
router, and its multi-turn demo must move KV both ways (P -> D READs, and D -> P history
reads on the long turn 3) and serve the short turns 2 and 4 on D from its own cache,
as the engines' counters say (`kvferry run` prints them after the demo). It caught a
router started without the deployment secret, whose lease requests D refused, so that no
turn ever reused D's KV."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from helpers_http import free_port

pytestmark = pytest.mark.engine


@pytest.mark.timeout(960)  # past its own 900 s bound on `kvferry run`, which then reports
@pytest.mark.parametrize("command", [["run"], ["up", "--demo", "--router-workers", "2"]],
                         ids=["run", "up-2-router-workers"])
def test_kvferry_run_moves_kv_both_ways(tmp_path, command):
    """With two router workers (sharing conversations through their SQLite file) the demo
    must go as with one. Run by hand before 183670f, it showed turn 3 reading turn 2's
    entry before turn 2 was stored (the stream's [DONE] went out first): read_failed,
    the history recomputed."""
    ports = [str(free_port()) for _ in range(3)]
    argv = [sys.executable, "-m", "kvferry.scripts.cli", *command, "--prefill-port", ports[0],
            "--decode-port", ports[1], "--router-port", ports[2]]
    env = {k: v for k, v in os.environ.items() if k != "KVFERRY_OPERATOR_TOKEN"}
    r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    # Engine identity is the operator's: `run` makes a token for its own router and demo,
    # so every turn names the D that served it (and P where one prefilled).
    served = re.findall(r"^turn \d: .*\(P (\S+), D (\S+)\)$", r.stdout, re.M)
    assert len(served) == 4 and {d for _, d in served} == {f"http://127.0.0.1:{ports[1]}"}, out[-3000:]
    assert served[0][0] == f"http://127.0.0.1:{ports[0]}", out[-3000:]
    assert "demo ok" in out and "all processes stopped" in out
    notes = re.findall(r"^turn (\d): .*?(?:(\d+) history tokens reused|(served by D from its "
                       r"own cache))", out, re.M)
    assert [t for t, _, _ in notes] == ["1", "2", "3", "4"], out[-3000:]
    assert notes[0][1:] == ("0", ""), out[-3000:]
    # Turns 2 and 4 found the previous turn's lease and stayed on D (a turn with no entry
    # would have gone to P: CI once saw turn 2 sent before turn 1's stream was recorded).
    assert notes[1][2] and notes[3][2], out[-3000:]
    assert int(notes[2][1] or 0) > 0, out[-3000:]  # turn 3, long: P read the history from D
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("transfers ")]
    moved = json.loads(line.removeprefix("transfers "))
    assert moved["decode"].get("reads_done") == 2, line  # P -> D on turns 1 and 3 only
    assert moved["prefill"].get("reuse_reads_done") == 1, line  # D -> P on turn 3
    for role in ("prefill", "decode"):  # nothing fell back or failed
        assert not {k for k in moved[role] if k.endswith("_failed") or k in (
            "recomputes", "sends_expired", "thread_errors", "unavailable")}, line
