"""The architecture contracts in pyproject.toml ([tool.importlinter]) hold: the layers of
connectors/, no import cycle, NIXL only in transport, vLLM only in the glue, a pure
protocol, and a router that uses no connector internals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(*args: str) -> subprocess.CompletedProcess[str]:
    """Run import-linter on this checkout (the kvferry package as PYTHONPATH maps it)."""
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_import_contracts_hold() -> None:
    r = lint_imports("--no-cache")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "BROKEN" not in r.stdout and "Contracts: 6 kept, 0 broken." in r.stdout


def test_a_contract_breaks_when_violated(tmp_path: Path) -> None:
    """The contracts bite: the same configuration with the layer order reversed fails."""
    cfg = (ROOT / "pyproject.toml").read_text()
    bad = cfg.replace('"scheduling | transfer",\n    "config",\n    "memory",\n    "protocol",',
                      '"scheduling | transfer",\n    "config",\n    "protocol",\n    "memory",')
    assert bad != cfg
    (tmp_path / "pyproject.toml").write_text(bad)
    r = lint_imports("--no-cache", "--config", str(tmp_path / "pyproject.toml"))
    assert r.returncode != 0 and "kvferry.connectors.memory" in r.stdout
