"""kvferry.neuron.envcheck_libfabric's answer (``envcheck --libfabric``) to "can NIXL's
LIBFABRIC backend load here, and if not why?", checked against what NIXL then actually
does on this host.

Each outcome is produced for real where it can be: the built libfabric with the stubs
(loads), the same with tcp confined to loopback (the ``fi_enable`` EBADF failure), a
FAKE libfabric lacking FABRIC_1.10 (tests/fakes/fake_libfabric.c), and canned ``ldd -v``
texts for the parser. Every real case runs envcheck's CLI and a NIXL agent in child
processes started with that environment (the loader reads LD_LIBRARY_PATH at exec).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import libfabric_host
import pytest

from kvferry.neuron import envcheck, envcheck_libfabric
from kvferry.neuron.envcheck_libfabric import (
    check_cuda_libs,
    check_libfabric_abi,
    check_plugin_hwloc,
    check_providers,
    parse_ldd,
)
from kvferry.neuron.findings import MISSING, OK, Finding

pytest.importorskip("nixl")
pytestmark = pytest.mark.timeout(300)
needs_build = pytest.mark.skipif(libfabric_host.skip_reason() is not None,
                                 reason=str(libfabric_host.skip_reason()))
# What NIXL itself exposes about its LIBFABRIC backend: the backends the agent created, or
# the exception type its bindings raised (never its log text).
PROBE = """
import json
import nixl._api as api
try:
    a = api.nixl_agent('probe', api.nixl_agent_config(backends=['LIBFABRIC']))
    print(json.dumps({"backends": sorted(a.backends), "error": None}))
except Exception as e:
    print(json.dumps({"backends": [], "error": type(e).__name__}))
"""


def report(env: dict[str, str]) -> dict[str, Finding]:
    r = subprocess.run([sys.executable, "-m", "kvferry.neuron.envcheck", "--libfabric", "--json"],
                       env=env, capture_output=True, text=True, timeout=120)
    out = json.loads(r.stdout)
    assert r.returncode == (0 if out["ok"] else 1), r.stderr
    return {f["check"]: Finding(**f) for f in out["findings"]}


def agent(env: dict[str, str]) -> dict[str, object]:
    """PROBE's answer in a child started with ``env``; a child that died before answering
    (the loader refused a library) is ``{"backends": [], "error": "exit <code>"}``."""
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                       timeout=120)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        return {"backends": [], "error": f"exit {r.returncode}"}
    return json.loads(lines[-1])


@needs_build
def test_built_libfabric_with_stubs_is_reported_ready_and_the_backend_starts() -> None:
    env = libfabric_host.env()
    found = report(env)
    assert all(f.status == OK for f in found.values()), found
    prefix = str(libfabric_host.prefix())
    assert found["libfabric-abi"].detail.startswith(prefix) and "FABRIC_1.10" in found["libfabric-abi"].detail
    assert f"{prefix}/stubs/libcuda.so.1" in found["cuda-libs"].detail
    assert found["fi-provider"].detail.startswith("the plugin would use tcp on ")
    assert agent(env) == {"backends": ["LIBFABRIC"], "error": None}


@needs_build
def test_loopback_only_tcp_is_reported_and_is_what_makes_fi_enable_fail() -> None:
    """The failure first met here (xnet_listen "socket listen failed", then fi_enable
    EBADF) was no ABI mismatch: tcp had only loopback addresses, which carry no
    FI_REMOTE_COMM. FI_TCP_IFACE=lo reproduces the loopback-only host."""
    env = libfabric_host.env() | {"FI_TCP_IFACE": "lo"}
    found = report(env)
    f = found["fi-provider"]
    assert f.status == MISSING and f.blocking and "EBADF" in f.detail
    assert all(found[c].status == OK for c in ("libfabric-abi", "cuda-libs", "plugin-hwloc"))
    assert agent(env) == {"backends": [], "error": "nixlBackendError"}  # NIXL's own type


def test_libfabric_without_fabric_1_10_is_named_and_the_plugin_does_not_load(tmp_path: Path) -> None:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc not found: cannot build the FAKE libfabric")
    src = Path(__file__).parent / "fakes" / "fake_libfabric.c"
    (tmp_path / "fake.map").write_text(
        "FABRIC_1.0 { global: fi_version; fi_getinfo; fi_freeinfo; fi_dupinfo; fi_fabric; "
        "fi_strerror; local: *; };\nFABRIC_1.1 { global: fi_getinfo; } FABRIC_1.0;\n")
    subprocess.run([gcc, "-shared", "-fPIC", "-o", str(tmp_path / "libfabric.so.1"),
                    "-Wl,-soname,libfabric.so.1", f"-Wl,--version-script={tmp_path / 'fake.map'}",
                    str(src)], check=True)
    env = dict(os.environ, LD_LIBRARY_PATH=f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    found = report(env)
    f = found["libfabric-abi"]
    assert f.status == MISSING and f.blocking
    assert f.detail.startswith(f"{tmp_path}/libfabric.so.1 lacks FABRIC_1.10")
    assert found["fi-provider"].detail == "not checked: no usable libfabric"
    assert "LIBFABRIC" not in agent(env)["backends"]


@needs_build
def test_missing_cuda_driver_is_named() -> None:
    if envcheck.find_library("libcuda.so.1"):
        pytest.skip("this host has a libcuda.so.1 (a CUDA driver): nothing is missing")
    prefix = libfabric_host.prefix()
    env = libfabric_host.env()
    env["LD_LIBRARY_PATH"] = env["LD_LIBRARY_PATH"].replace(f"{prefix}/stubs", "/nonexistent")
    f = report(env)["cuda-libs"]
    assert f.status == MISSING and f.detail.startswith("libcuda.so.1 not found")
    assert "LIBFABRIC" not in agent(env)["backends"]


OK_LDD = """\
\tlinux-vdso.so.1 (0x00007f0ad81b8000)
\tlibfabric.so.1 => /opt/lf/lib/libfabric.so.1 (0x00007f0ad7ebc000)
\tlibcudart.so.13 => /opt/lf/stubs/libcudart.so.13 (0x00007f0ad7ea7000)
\tlibcuda.so.1 => /opt/lf/stubs/libcuda.so.1 (0x00007f0ad7ea2000)
\tlibhwloc.so.15 => /lib/x86_64-linux-gnu/libhwloc.so.15 (0x00007f0ad7e45000)

\tVersion information:
\t/site/.nixl_cu13.mesonpy.libs/plugins/libplugin_LIBFABRIC.so:
\t\tlibfabric.so.1 (FABRIC_1.0) => /opt/lf/lib/libfabric.so.1
\t\tlibfabric.so.1 (FABRIC_1.10) => /opt/lf/lib/libfabric.so.1
\t\tlibcudart.so.13 (libcudart.so.13) => /opt/lf/stubs/libcudart.so.13
\t/lib/x86_64-linux-gnu/libhwloc.so.15:
\t\tlibudev.so.1 (LIBUDEV_183) => /lib/x86_64-linux-gnu/libudev.so.1
"""
BAD_LDD = """\
\tlibfabric.so.1 => /usr/lib/libfabric.so.1 (0x00007f2148015000)
\tlibcudart.so.13 => not found
\tlibcuda.so.1 => not found
\tlibhwloc.so.15 => not found

\tVersion information:
\t/site/plugins/libplugin_LIBFABRIC.so:
\t\tlibfabric.so.1 (FABRIC_1.0) => /usr/lib/libfabric.so.1
\t\tlibfabric.so.1 (FABRIC_1.10) => not found
"""


def test_parsed_ldd_findings_on_both_outcomes() -> None:
    ok = parse_ldd(OK_LDD)
    assert ok.versions == {"libfabric.so.1": {"FABRIC_1.0": True, "FABRIC_1.10": True},
                           "libcudart.so.13": {"libcudart.so.13": True}}  # libhwloc's own needs ignored
    assert [f.status for f in (check_libfabric_abi(ok), check_cuda_libs(ok), check_plugin_hwloc(ok))
            ] == [OK] * 3
    bad = parse_ldd(BAD_LDD)
    abi, cuda, hwloc = check_libfabric_abi(bad), check_cuda_libs(bad), check_plugin_hwloc(bad)
    assert abi.detail == ("/usr/lib/libfabric.so.1 lacks FABRIC_1.10 "
                          "(the plugin needs FABRIC_1.0, FABRIC_1.10)")
    assert cuda.detail == "libcuda.so.1, libcudart.so.13 not found by the plugin's loader"
    assert hwloc.status == MISSING
    assert all(f.blocking for f in (abi, cuda, hwloc))
    assert check_providers(None).blocking


def test_main_with_libfabric_runs_only_those_checks(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(envcheck, "run_checks", lambda *a, **k: pytest.fail("ran every check"))
    monkeypatch.setattr(envcheck_libfabric, "libfabric_checks", lambda: [
        Finding("fi-provider", MISSING, "no provider", "", True)])
    assert envcheck.main(["--libfabric"]) == 1
    assert "NIXL cannot create its LIBFABRIC backend here" in capsys.readouterr().out
