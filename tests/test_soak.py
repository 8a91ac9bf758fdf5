"""`kvferry soak`'s result lines (scripts/soak.py): the books of each segment become one
line, counts cumulative since the start; the run itself is a benchmark, not a test
(benchmarks/results/soak-cpu-*.jsonl)."""

from __future__ import annotations

from collections import Counter

from typer.testing import CliRunner

from kvferry.scripts.chaos import Books
from kvferry.scripts.cli import app
from kvferry.scripts.soak import segment_line


def test_a_segment_line_carries_the_books_and_the_running_totals() -> None:
    b = Books(leaked={"d0": 3.0, "p1": float("nan")}, crashes=["p0-2.log: exit 1"],
              violations=["d0: 3 KV blocks not freed within 44s"],
              corruptions_injected=4, corruptions_caught=4)
    totals = Counter(requests=120, ok=117, error=2, wrong=1, faults=20)
    line = segment_line(2, b, totals, 1234.5, {"router": 180.0, "d0": 2100.0},
                        {"experiment": "soak", "seed": 1})
    assert line["experiment"] == "soak" and line["segment"] == 2 and line["elapsed_s"] == 1234
    assert (line["requests"], line["ok"], line["errors"], line["wrong_outputs"],
            line["hangs"]) == (120, 117, 2, 1, 0)
    assert line["leaked_blocks"] == 3.0  # an engine that did not answer (nan) is no count
    assert (line["checksum_mismatches"], line["corruptions_injected"]) == (4, 4)
    assert line["crashes"] == 1 and line["violations"] == b.violations
    assert line["rss_mb"] == {"router": 180.0, "d0": 2100.0}


def test_the_cli_offers_soak_with_its_segments() -> None:
    out = CliRunner().invoke(app, ["soak", "--help"], terminal_width=200)
    assert out.exit_code == 0
    for opt in ("--duration", "--every", "--fault-every", "--seed", "--results"):
        assert opt in out.output
