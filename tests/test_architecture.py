"""The architecture contracts in pyproject.toml ([tool.importlinter]) hold: the layers of
connectors/, no import cycle, NIXL only in transport, vLLM only in the glue, a pure
protocol, and a router that uses no connector internals."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(*args: str) -> subprocess.CompletedProcess[str]:
    """Run import-linter on this checkout.

    import-linter (grimp) walks the package's directories, which setuptools' editable
    finder does not expose for the namespace package ``kvferry``: so the run sees kvferry
    through a directory of symlinks (kvferry/connectors -> connectors/ ...) on PYTHONPATH."""
    shim = Path(tempfile.mkdtemp(prefix="kvferry-imports-"))
    (shim / "kvferry").mkdir()
    for top in ("connectors", "router", "neuron", "scripts"):
        (shim / "kvferry" / top).symlink_to(ROOT / top)
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(shim),
                                                                      os.environ.get("PYTHONPATH"))))}
    try:
        return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, env=env)
    finally:
        shutil.rmtree(shim)


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
