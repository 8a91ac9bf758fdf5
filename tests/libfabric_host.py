"""The libfabric that .ci/build_libfabric.py built for NIXL's LIBFABRIC plugin, and the
environment a process needs to load that plugin with it.

The loader resolves the plugin's libfabric.so.1 / libcuda.so.1 / libcudart.so.N when
NIXL dlopens it, from LD_LIBRARY_PATH as it was when the process started: so only
processes started with :func:`env` can use the backend (the tests spawn their agents).
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


@cache
def builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_libfabric", ROOT / ".ci" / "build_libfabric.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@cache
def prefix() -> Path | None:
    """The built prefix for the vendored snapshot, or None (see :func:`skip_reason`)."""
    b = builder()
    tarball = b.default_vendor() / b.SNAPSHOT
    if not tarball.is_file():
        return None
    p = b.prefix_for(tarball, b.default_opt())
    return p if b.built(p) else None


def skip_reason() -> str | None:
    b = builder()
    vendor = b.default_vendor()
    if not (vendor / b.SNAPSHOT).is_file():
        return (f"no {vendor / b.SNAPSHOT}: the LIBFABRIC tests need the vendored libfabric "
                "snapshot (a user's host has its own libfabric; see kvferry.neuron.envcheck)")
    if prefix() is None:
        return "libfabric not built yet: run bash .ci/setup --tests (or python .ci/build_libfabric.py)"
    return None


def env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: os.environ) plus what the plugin needs to load and pick tcp.

    FI_PROVIDER restricts libfabric to the named providers (ofiwg/libfabric man/fabric.7.md,
    "FI_PROVIDER"; the plugin itself prefers cxi > efa > tcp > sockets: ai-dynamo/nixl
    src/utils/libfabric/libfabric_common.cpp, getAvailableNetworkDevices)."""
    p = prefix()
    assert p is not None, skip_reason()
    out = dict(os.environ if base is None else base)
    paths = [str(p / "lib"), str(p / "stubs")] + [d for d in out.get("LD_LIBRARY_PATH", "").split(":") if d]
    out["LD_LIBRARY_PATH"] = ":".join(paths)
    out["FI_PROVIDER"] = "tcp"
    return out
