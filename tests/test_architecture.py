"""The architecture contracts in pyproject.toml ([tool.importlinter]) hold: the layers of
connectors/, no import cycle, NIXL only in transport, vLLM only in the glue, a pure
protocol, and a router that uses no connector internals. And no test module imports
another: what tests share lives in tests/helpers_*.py, stack.py, fleet_stack.py."""

from __future__ import annotations

import ast
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
    assert "BROKEN" not in r.stdout and "Contracts: 8 kept, 0 broken." in r.stdout


def test_a_contract_breaks_when_violated(tmp_path: Path) -> None:
    """The contracts bite: the same configuration with the layer order reversed fails."""
    cfg = (ROOT / "pyproject.toml").read_text()
    bad = cfg.replace('"scheduling | transfer",\n    "config",\n    "memory",\n    "protocol",',
                      '"scheduling | transfer",\n    "config",\n    "protocol",\n    "memory",')
    assert bad != cfg
    (tmp_path / "pyproject.toml").write_text(bad)
    r = lint_imports("--no-cache", "--config", str(tmp_path / "pyproject.toml"))
    assert r.returncode != 0 and "kvferry.connectors.memory" in r.stdout


TESTS = ROOT / "tests"


def _test_module(name: str) -> str | None:
    """The test_* module a dotted import name refers to (``tests.test_x`` is test_x)."""
    parts = name.split(".")
    first = parts[1] if parts[0] == "tests" and len(parts) > 1 else parts[0]
    return first if first.startswith("test_") else None


def imported_test_modules(path: Path) -> set[str]:
    """The test_* modules ``path`` imports (absolute or relative)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names.append(base)
            if node.level or base == "tests":  # from . import test_x, from tests import test_x
                names += [a.name for a in node.names]
    return {m for n in names if (m := _test_module(n))}


def imports_between_test_modules() -> set[tuple[str, str]]:
    """(importing file under tests/, imported test module) for every .py under tests/."""
    return {(str(p.relative_to(TESTS)), m) for p in sorted(TESTS.rglob("*.py"))
            for m in imported_test_modules(p)}


def test_no_test_module_imports_another() -> None:
    """A test module imported by another runs its module-level code (fixtures, marks,
    skips) twice and couples the two; shared helpers live in tests/helpers_*.py."""
    found = imports_between_test_modules()
    assert found == set(), f"move what these share into tests/helpers_*.py: {sorted(found)}"


def test_the_test_import_check_sees_every_form(tmp_path: Path) -> None:
    forms = {"import test_a": {"test_a"}, "from test_b import x": {"test_b"},
             "import tests.test_c as c": {"test_c"}, "from tests.test_d import y": {"test_d"},
             "from . import test_e": {"test_e"}, "from .test_f import z": {"test_f"},
             "from tests import test_g": {"test_g"}, "import os, helpers_http": set(),
             "from stack import test_like_name": set(), "from tests import helpers_x": set()}
    for code, want in forms.items():
        (tmp_path / "m.py").write_text(code + "\n")
        assert imported_test_modules(tmp_path / "m.py") == want, code
