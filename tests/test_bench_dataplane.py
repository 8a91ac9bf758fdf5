"""benchmarks/router_dataplane.py's `kvferry@N` target: the running router's command line
with `--port` and `--workers` set, which `kvferry router` must still parse."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from kvferry.scripts.cli import app as kvferry_app

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from router_dataplane import with_option  # noqa: E402


def test_with_option_replaces_both_spellings_and_appends_what_is_missing() -> None:
    cmd = ["kvferry", "router", "--port", "8000", "--decode", "http://d:8200", "--port=9"]
    got = with_option(with_option(cmd, "--port", "8123"), "--workers", "4")
    assert got == ["kvferry", "router", "--decode", "http://d:8200", "--port", "8123",
                   "--workers", "4"]


def test_the_derived_command_line_is_parsed_by_kvferry_router() -> None:
    up_router = ["python3", "-m", "kvferry.scripts.cli", "router", "--prefill",
                 "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200", "--port", "8000",
                 "--workers", "1", "--health-interval", "0"]
    argv = with_option(with_option(up_router, "--port", "8123"), "--workers", "4")
    router = typer.main.get_command(kvferry_app).commands["router"]  # type: ignore[attr-defined]
    ctx = router.make_context("router", argv[argv.index("router") + 1:])
    assert ctx.params["port"] == 8123 and ctx.params["workers"] == 4
    assert ctx.params["decode"] == ["http://127.0.0.1:8200"]
