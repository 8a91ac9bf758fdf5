"""Is this host ready for device-to-device KV transfer on Trainium?

Each check returns a :class:`Finding` that says what was found and, when something is
missing, what to do about it. ``python -m kvferry.neuron.envcheck`` prints the report and
exits 1 when a blocking problem would stop NIXL's LIBFABRIC backend from moving Neuron
HBM directly (``neuron_staging: auto`` then falls back to mapped HBM or host staging at
engine start; see :mod:`kvferry.neuron.backend`). ``--libfabric`` only answers whether
NIXL's LIBFABRIC backend can be created on this host at all, and why not: the plugin, the
libraries its loader binds (libfabric's FABRIC_1.10 ABI, libcuda/libcudart, hwloc) and the
provider and device it would open (any provider: tcp in CI).

Nothing here starts the Neuron runtime. libfabric only dlopens libnrt and calls
``nrt_get_total_nc_count``, which nrt.h allows before ``nrt_init`` (ofiwg/libfabric
``src/hmem_neuron.c``, ``neuron_hmem_init``); NIXL's LIBFABRIC plugin only dlopens libnrt
for ``nrt_get_attached_efa_bdf`` (ai-dynamo/nixl ``src/plugins/libfabric/
libfabric_backend.cpp``); the framework (libtorch-neuronx in vllm-neuron) starts the
runtime. So there is no "nrt_init before libfabric" order to enforce, and a connector
that called ``nrt_init`` itself would be a second, undocumented init.

"""


from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

from . import envcheck_libfabric
from .findings import MISSING, WARN, Finding, blocking, passed

# The --libfabric checks (NIXL's plugin, its loader's libraries, the provider it would
# open) are envcheck_libfabric's; this module holds the Trainium host checks (Neuron
# runtime, libfabric's version, hwloc, EFA devices, the efa provider's SHM and HMEM), the
# full report of both and the CLI.

MIN_LIBFABRIC = (1, 21)
MIN_HWLOC = (2, 10)
LIBFABRIC_DIRS = ("/opt/amazon/efa/lib", "/opt/amazon/efa/lib64")

# -- shared-library discovery ---------------------------------------------------------------
def _ldconfig_paths(soname: str) -> list[str]:
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [ln.rsplit("=>", 1)[1].strip() for ln in out.splitlines()
            if ln.strip().startswith(soname + " ") and "=>" in ln]


def find_library(soname: str, extra_dirs: tuple[str, ...] = ()) -> str | None:
    """First path of ``soname``: explicit dirs, LD_LIBRARY_PATH, then the ldconfig cache."""
    dirs = list(extra_dirs) + [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    for d in dirs:
        p = os.path.join(d, soname)
        if os.path.exists(p):
            return p
    found = _ldconfig_paths(soname)
    return found[0] if found else None


def hwloc_api_version(path: str) -> tuple[int, int]:
    """hwloc_get_api_version() of the library at ``path`` (major, minor)."""
    lib = ctypes.CDLL(path)
    lib.hwloc_get_api_version.restype = ctypes.c_uint
    v = lib.hwloc_get_api_version()
    return v >> 16, (v >> 8) & 0xFF


@dataclass(frozen=True)
class _Lib:
    """A shared library a check loads to read its version."""

    check: str
    missing: str  # what fails without it
    fix: str
    version: Callable[[str], tuple[int, int]]
    minimum: tuple[int, int]
    old_blocks: bool  # an older one cannot work (else: a warning)


def _check_lib(lib: _Lib, path: str | None) -> Finding:
    if not path:
        return Finding(lib.check, MISSING, lib.missing, lib.fix, blocking=True)
    try:
        got = lib.version(path)
    except (OSError, AttributeError) as e:
        return Finding(lib.check, MISSING, f"{path} unusable: {e}", lib.fix, blocking=True)
    have, need = ".".join(map(str, got)), ".".join(map(str, lib.minimum))
    if got < lib.minimum:
        return Finding(lib.check, MISSING if lib.old_blocks else WARN,
                       f"{path} is {have}, need >= {need}", lib.fix, blocking=lib.old_blocks)
    return passed(lib.check, f"{path} version {have}")


def libfabric_version(path: str) -> tuple[int, int]:
    """fi_version() of the library at ``path`` (FI_MAJOR = v >> 16, FI_MINOR = v & 0xffff)."""
    lib = ctypes.CDLL(path)
    lib.fi_version.restype = ctypes.c_uint32
    lib.fi_version.argtypes = []
    v = lib.fi_version()
    return v >> 16, v & 0xFFFF


# -- checks ---------------------------------------------------------------------------------
def check_libnrt() -> Finding:
    from kvferry.neuron import libnrt

    try:
        lib = libnrt.load()
    except libnrt.LibnrtNotFound as e:
        return Finding("libnrt", MISSING, str(e).split(". Install")[0],
                       "install aws-neuronx-runtime-lib (Neuron SDK apt repo) or set "
                       f"${libnrt.ENV_LIBNRT}", blocking=True)
    extra = "" if lib.has_efa_bdf else " (no nrt_get_attached_efa_bdf: runtime < 2.31, "\
        "NIXL will use all EFA rails)"
    try:  # nrt.h: callable before nrt_init, so this starts nothing
        cores = f", {lib.total_nc_count()} NeuronCores"
    except libnrt.NrtError as e:
        cores = f", NeuronCore count unknown ({e})"
    return passed("libnrt", f"loaded {lib.path}{cores}{extra}")


def check_map_hbm(env: Mapping[str, str]) -> Finding:
    """NEURON_RT_MAP_HBM=1 is what the mapped-HBM registration mode needs: AWS's
    disagg_serve_vllm sample exports it, and vllm-neuron's worker sets it before it starts
    the runtime (aws-neuron/aws-neuron-eks-samples disagg_serve_vllm/prefill-deploy.yaml;
    vllm-project/vllm-neuron vllm_neuron/vllm/worker/neuron_worker.py)."""
    v = env.get("NEURON_RT_MAP_HBM")
    if v == "1":
        return passed("map-hbm", "NEURON_RT_MAP_HBM=1: HBM is mapped into host address space "
                   "(neuron_staging: mapped can register it as DRAM)")
    return Finding("map-hbm", WARN, f"NEURON_RT_MAP_HBM={v!r}: the mapped-HBM mode is "
                   "unavailable unless the framework sets it (vllm-neuron's worker does)",
                   "export NEURON_RT_MAP_HBM=1 before the engine starts")


def check_libfabric(path: str | None = None) -> Finding:
    return _check_lib(_Lib(
        "libfabric", "libfabric.so.1 not found (NIXL LIBFABRIC backend cannot load)",
        "install the AWS EFA installer (aws-efa-installer, provides /opt/amazon/efa/lib/"
        "libfabric.so.1 >= 1.21 with Neuron HMEM) or build libfabric >= 1.21",
        libfabric_version, MIN_LIBFABRIC, old_blocks=True),
        path or find_library("libfabric.so.1", LIBFABRIC_DIRS))


def check_hwloc(path: str | None = None) -> Finding:
    return _check_lib(_Lib(
        "hwloc", "libhwloc.so.15 not found (NIXL LIBFABRIC uses it to find Neuron devices "
        "and EFA topology)",
        "apt install libhwloc15 (>= 2.10; Debian 12 ships 2.9: build hwloc 2.10+ or use "
        "AL2023/Ubuntu 24.04)", hwloc_api_version, MIN_HWLOC, old_blocks=False),
        path or find_library("libhwloc.so.15"))


def check_efa_devices(sysfs: str = "/sys/class/infiniband") -> Finding:
    devs = []
    for d in sorted(glob.glob(os.path.join(sysfs, "*"))):
        drv = os.path.join(d, "device", "driver")
        name = os.path.basename(d)
        if "efa" in name or (os.path.islink(drv) and os.path.basename(os.readlink(drv)) == "efa"):
            devs.append(name)
    if devs:
        return passed("efa-devices", f"{len(devs)} EFA device(s): {', '.join(devs)}")
    fi_info = shutil.which("fi_info")
    if fi_info:
        r = subprocess.run([fi_info, "-p", "efa"], capture_output=True, text=True, timeout=20)
        if r.returncode == 0 and "provider: efa" in r.stdout:
            return passed("efa-devices", "fi_info -p efa lists the efa provider")
    return Finding("efa-devices", MISSING, f"no EFA device in {sysfs} and `fi_info -p efa` "
                   "shows none", "launch on an EFA-enabled instance (trn2/p5en) with EFA "
                   "interfaces attached and the efa kernel module loaded", blocking=True)


def check_shm(colocated: bool, env: Mapping[str, str]) -> Finding:
    v = env.get("FI_EFA_ENABLE_SHM_TRANSFER")
    if not colocated:
        return passed("efa-shm", "P and D on separate instances; FI_EFA_ENABLE_SHM_TRANSFER "
                   f"{'unset' if v is None else '=' + v}")
    if v == "0":
        return passed("efa-shm", "FI_EFA_ENABLE_SHM_TRANSFER=0 (required with P and D on one instance)")
    return Finding("efa-shm", MISSING, f"P and D share this instance but FI_EFA_ENABLE_SHM_TRANSFER="
                   f"{v!r}", "export FI_EFA_ENABLE_SHM_TRANSFER=0 for every engine on this host",
                   blocking=True)


def check_hmem(env: Mapping[str, str]) -> Finding:
    hints = []
    if env.get("FI_EFA_USE_DEVICE_RDMA") != "1":
        hints.append("set FI_EFA_USE_DEVICE_RDMA=1")
    if env.get("FI_HMEM") not in (None, "", "neuron"):
        hints.append(f"FI_HMEM={env['FI_HMEM']!r} excludes neuron")
    fi_info = shutil.which("fi_info")
    detail = "cannot verify FI_HMEM support (fi_info not found)"
    if fi_info:
        r = subprocess.run([fi_info, "-p", "efa", "-c", "FI_HMEM"], capture_output=True,
                           text=True, timeout=20)
        if r.returncode == 0 and "provider: efa" in r.stdout:
            detail = "efa provider reports FI_HMEM"
        else:
            detail = "efa provider does not report FI_HMEM: NIXL falls back to system-memory "\
                "registration (silent slow path)"
            hints.append("use a libfabric built with Neuron HMEM (AWS EFA installer)")
    if hints:
        return Finding("fi-hmem", WARN, detail, "; ".join(hints))
    return passed("fi-hmem", detail)


def run_checks(colocated: bool = False, env: Mapping[str, str] | None = None) -> list[Finding]:
    """All findings. None of them initialises the Neuron runtime."""
    env = os.environ if env is None else env
    checks: list[Callable[[], Finding]] = [
        check_libnrt, check_libfabric, check_hwloc, check_efa_devices,
        lambda: check_shm(colocated, env), lambda: check_hmem(env), lambda: check_map_hbm(env),
    ]
    return [c() for c in checks] + envcheck_libfabric.libfabric_checks()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvferry.neuron.envcheck", description=__doc__)
    ap.add_argument("--colocated", action="store_true",
                    help="prefill and decode engines share this instance")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--libfabric", action="store_true",
                    help="only whether NIXL's LIBFABRIC backend can load here (any provider)")
    args = ap.parse_args(argv)
    findings = (envcheck_libfabric.libfabric_checks() if args.libfabric
                else run_checks(args.colocated))
    bad = blocking(findings)
    if args.json:
        print(json.dumps({"ok": not bad, "findings": [asdict(f) for f in findings]}, indent=2))
    else:
        for f in findings:
            print(f.line())
        why = ("NIXL cannot create its LIBFABRIC backend here" if args.libfabric else
               "device registration will fail; neuron_staging: auto falls back to mapped HBM "
               "or host staging")
        print(f"\n{len(bad)} blocking problem(s)" + (f": {why}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
