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
import ctypes.util
import glob
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

OK, MISSING, WARN = "ok", "missing", "warn"
MIN_LIBFABRIC = (1, 21)
MIN_HWLOC = (2, 10)
LIBFABRIC_DIRS = ("/opt/amazon/efa/lib", "/opt/amazon/efa/lib64")


@dataclass(frozen=True)
class Finding:
    check: str
    status: str  # ok | missing | warn
    detail: str
    fix: str = ""
    blocking: bool = False

    def line(self) -> str:
        mark = {OK: "[ ok ]", MISSING: "[FAIL]" if self.blocking else "[miss]", WARN: "[warn]"}
        s = f"{mark[self.status]} {self.check}: {self.detail}"
        return s + (f"\n       -> {self.fix}" if self.fix else "")


def _ok(check: str, detail: str) -> Finding:
    return Finding(check, OK, detail)


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
    return _ok("libnrt", f"loaded {lib.path}{cores}{extra}")


def check_map_hbm(env: Mapping[str, str]) -> Finding:
    """NEURON_RT_MAP_HBM=1 is what the mapped-HBM registration mode needs: AWS's
    disagg_serve_vllm sample exports it, and vllm-neuron's worker sets it before it starts
    the runtime (aws-neuron/aws-neuron-eks-samples disagg_serve_vllm/prefill-deploy.yaml;
    vllm-project/vllm-neuron vllm_neuron/vllm/worker/neuron_worker.py)."""
    v = env.get("NEURON_RT_MAP_HBM")
    if v == "1":
        return _ok("map-hbm", "NEURON_RT_MAP_HBM=1: HBM is mapped into host address space "
                   "(neuron_staging: mapped can register it as DRAM)")
    return Finding("map-hbm", WARN, f"NEURON_RT_MAP_HBM={v!r}: the mapped-HBM mode is "
                   "unavailable unless the framework sets it (vllm-neuron's worker does)",
                   "export NEURON_RT_MAP_HBM=1 before the engine starts")


def check_libfabric(path: str | None = None) -> Finding:
    path = path or find_library("libfabric.so.1", LIBFABRIC_DIRS)
    fix = ("install the AWS EFA installer (aws-efa-installer, provides /opt/amazon/efa/lib/"
           "libfabric.so.1 >= 1.21 with Neuron HMEM) or build libfabric >= 1.21")
    if not path:
        return Finding("libfabric", MISSING, "libfabric.so.1 not found (NIXL LIBFABRIC backend "
                       "cannot load)", fix, blocking=True)
    try:
        major, minor = libfabric_version(path)
    except (OSError, AttributeError) as e:
        return Finding("libfabric", MISSING, f"{path} unusable: {e}", fix, blocking=True)
    if (major, minor) < MIN_LIBFABRIC:
        return Finding("libfabric", MISSING, f"{path} is {major}.{minor}, need >= "
                       f"{MIN_LIBFABRIC[0]}.{MIN_LIBFABRIC[1]}", fix, blocking=True)
    return _ok("libfabric", f"{path} version {major}.{minor}")


def check_hwloc(path: str | None = None) -> Finding:
    path = path or find_library("libhwloc.so.15")
    fix = ("apt install libhwloc15 (>= 2.10; Debian 12 ships 2.9: build hwloc 2.10+ "
           "or use AL2023/Ubuntu 24.04)")
    if not path:
        return Finding("hwloc", MISSING, "libhwloc.so.15 not found (NIXL LIBFABRIC uses it to "
                       "find Neuron devices and EFA topology)", fix, blocking=True)
    try:
        lib = ctypes.CDLL(path)
        lib.hwloc_get_api_version.restype = ctypes.c_uint
        v = lib.hwloc_get_api_version()
    except (OSError, AttributeError) as e:
        return Finding("hwloc", MISSING, f"{path} unusable: {e}", fix, blocking=True)
    ver = (v >> 16, (v >> 8) & 0xFF)
    if ver < MIN_HWLOC:
        return Finding("hwloc", WARN, f"{path} API {ver[0]}.{ver[1]} < 2.10", fix)
    return _ok("hwloc", f"{path} API {ver[0]}.{ver[1]}")


def unresolved(ldd_output: str) -> list[str]:
    """What ``ldd`` could not resolve: missing libraries, and symbol versions a present
    library lacks (a libfabric older than the one NIXL was built against is found by the
    loader but lacks e.g. FABRIC_1.10, and the plugin then fails to load)."""
    out = set()
    for ln in ldd_output.splitlines():
        if m := re.search(r"version `([^']+)' not found", ln):
            lib = ln.split(":")[1].strip() if ln.count(":") >= 2 else ""
            out.add(f"{m.group(1)} (not in {os.path.basename(lib) or 'a loaded library'})")
        elif "not found" in ln:
            out.add(ln.split()[0])
    return sorted(out)


def plugin_path() -> str | None:
    """The libplugin_LIBFABRIC.so NIXL would load: $NIXL_PLUGIN_DIR's when set, else the
    wheel variant ``import nixl`` picks (nixl_cu<major> for the CUDA stack torch was built
    with, else nixl_cu13, then nixl_cu12: nixl/__init__.py, _load_cuda_backend)."""
    own = os.path.join(os.environ.get("NIXL_PLUGIN_DIR", "/nonexistent"), "libplugin_LIBFABRIC.so")
    if os.path.exists(own):
        return own
    spec = importlib.util.find_spec("nixl")
    if spec is None or not spec.submodule_search_locations:
        return None
    site = Path(next(iter(spec.submodule_search_locations))).parent
    order = ["cu13", "cu12"]
    try:
        from nixl_meta_utils import detect_cuda_major

        if (major := detect_cuda_major()) is not None:
            order.insert(0, f"cu{major}")
    except ImportError:
        pass
    for variant in order:
        for d in (f".nixl_{variant}.mesonpy.libs", f"nixl_{variant}.libs"):
            p = site / d / "plugins" / "libplugin_LIBFABRIC.so"
            if p.exists():
                return str(p)
    found = sorted(glob.glob(str(site / ".nixl*libs" / "plugins" / "libplugin_LIBFABRIC.so")))
    return found[-1] if found else None


def check_nixl_plugin() -> Finding:
    """Is NIXL's LIBFABRIC plugin installed and are its system dependencies resolvable?"""
    if importlib.util.find_spec("nixl") is None:
        return Finding("nixl-libfabric", MISSING, "nixl is not installed", "pip install nixl",
                       blocking=True)
    plugin = plugin_path()
    if not plugin:
        return Finding("nixl-libfabric", MISSING, "no libplugin_LIBFABRIC.so in the nixl wheel",
                       "install a nixl build with the LIBFABRIC plugin (>= 0.10)", blocking=True)
    ldd = shutil.which("ldd")
    if ldd:
        r = subprocess.run([ldd, plugin], capture_output=True, text=True, timeout=20)
        missing = unresolved(r.stdout + r.stderr)
        if missing:
            return Finding("nixl-libfabric", MISSING, f"{plugin} cannot resolve "
                           + ", ".join(missing),
                           "install those libraries (Neuron hosts: EFA installer for a libfabric "
                           "as new as the one NIXL was built against; the Neuron libcuda stub "
                           "for libcuda/libcudart)", blocking=True)
    return _ok("nixl-libfabric", plugin)


# -- can NIXL's LIBFABRIC plugin load here, and with what? ------------------------------------
@dataclass(frozen=True)
class PluginLibs:
    """What ``ldd -v`` says the plugin's loader would bind: soname -> path (None: not
    found), and soname -> {symbol version it requires: provided?}."""

    paths: dict[str, str | None]
    versions: dict[str, dict[str, bool]]


def parse_ldd(text: str) -> PluginLibs:
    """``ldd -v <plugin>`` output -> PluginLibs (only the plugin's own version needs: the
    first block under "Version information")."""
    paths: dict[str, str | None] = {}
    versions: dict[str, dict[str, bool]] = {}
    blocks = 0
    for ln in text.splitlines():
        if ln.strip() == "Version information:":
            blocks = 0
            continue
        if (m := re.match(r"\t(\S+) => (not found|(\S+) \(0x[0-9a-f]+\))$", ln)) and not blocks:
            paths[m.group(1)] = m.group(3)
        elif re.match(r"\t\S.*:$", ln) and "=>" not in ln:
            blocks += 1
        elif blocks == 1 and (m := re.match(r"\t\t(\S+) \((\S+)\) => (.+)$", ln)):
            versions.setdefault(m.group(1), {})[m.group(2)] = m.group(3).strip() != "not found"
    return PluginLibs(paths, versions)


def plugin_libs(plugin: str) -> PluginLibs | None:
    ldd = shutil.which("ldd")
    if not ldd:
        return None
    r = subprocess.run([ldd, "-v", plugin], capture_output=True, text=True, timeout=20)
    return parse_ldd(r.stdout)


def check_libfabric_abi(libs: PluginLibs) -> Finding:
    """The libfabric the plugin binds must export every symbol version it was linked
    with: NIXL 1.5.1's needs FABRIC_1.10, which no tagged libfabric up to v2.6.0 exports
    (../shared/vendor/README.md); the loader then refuses the plugin."""
    path = libs.paths.get("libfabric.so.1")
    need = libs.versions.get("libfabric.so.1", {})
    fix = ("put a libfabric exporting it first on LD_LIBRARY_PATH (ofiwg/libfabric from "
           "c459d6a51 on, e.g. .ci/build_libfabric.py; on EFA hosts an EFA installer that ships it)")
    if "libfabric.so.1" not in libs.paths:
        return _ok("libfabric-abi", "the plugin does not link libfabric.so.1")
    if path is None:
        return Finding("libfabric-abi", MISSING, "libfabric.so.1 not found by the plugin's loader",
                       fix, blocking=True)
    lacking = sorted(v for v, ok in need.items() if not ok)
    if lacking:
        return Finding("libfabric-abi", MISSING, f"{path} lacks {', '.join(lacking)} (the plugin "
                       f"needs {', '.join(sorted(need))})", fix, blocking=True)
    return _ok("libfabric-abi", f"{path} exports {', '.join(sorted(need)) or 'what the plugin needs'}")


def check_cuda_libs(libs: PluginLibs) -> Finding:
    """The plugin links the CUDA driver and runtime even where nothing calls them
    (DRAM, Neuron): Neuron hosts give it no-op stubs (AWS's disagg_serve_vllm sample)."""
    cuda = {k: v for k, v in libs.paths.items() if k.startswith(("libcuda.so", "libcudart.so"))}
    missing = sorted(k for k, v in cuda.items() if v is None)
    if missing:
        return Finding("cuda-libs", MISSING, f"{', '.join(missing)} not found by the plugin's loader",
                       "install the CUDA driver/runtime, or no-op stubs where there is no GPU "
                       "(kvferry.scripts.neuron_env.neuron_prelude builds libcuda.so.1; "
                       ".ci/build_libfabric.py both)", blocking=True)
    return _ok("cuda-libs", ", ".join(f"{k} => {v}" for k, v in sorted(cuda.items())) or "none linked")


def check_plugin_hwloc(libs: PluginLibs) -> Finding:
    path = libs.paths.get("libhwloc.so.15", "")
    if path is None:
        return Finding("plugin-hwloc", MISSING, "libhwloc.so.15 not found by the plugin's loader "
                       "(it maps NICs to NUMA nodes and accelerators)", "apt install libhwloc15",
                       blocking=True)
    return _ok("plugin-hwloc", path or "not linked")


# fi_getinfo's hints and structs, from ofiwg/libfabric include/rdma/fabric.h: these fields
# have kept their place in every FABRIC_1.x ABI (later ones only append).
FI_MSG, FI_RMA = 1 << 1, 1 << 2
FI_LOCAL_COMM, FI_REMOTE_COMM = 1 << 51, 1 << 52
FI_CONTEXT = 1 << 59
FI_EP_RDM = 3
FI_VERSION_1_18 = (1 << 16) | 18  # what the plugin asks for
NIXL_PROVIDERS = ("cxi", "efa", "tcp", "sockets")  # its order of preference


class _FabricAttr(ctypes.Structure):
    _fields_ = [("fabric", ctypes.c_void_p), ("name", ctypes.c_char_p),
                ("prov_name", ctypes.c_char_p)]


class _DomainAttr(ctypes.Structure):
    _fields_ = [("domain", ctypes.c_void_p), ("name", ctypes.c_char_p)] + [
        (f, ctypes.c_int) for f in ("threading", "control_progress", "data_progress",
                                    "resource_mgmt", "av_type", "mr_mode")]


class _EpAttr(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int)]


class _Info(ctypes.Structure):
    pass


_Info._fields_ = [
    ("next", ctypes.POINTER(_Info)), ("caps", ctypes.c_uint64), ("mode", ctypes.c_uint64),
    ("addr_format", ctypes.c_uint32), ("src_addrlen", ctypes.c_size_t),
    ("dest_addrlen", ctypes.c_size_t), ("src_addr", ctypes.c_void_p),
    ("dest_addr", ctypes.c_void_p), ("handle", ctypes.c_void_p), ("tx_attr", ctypes.c_void_p),
    ("rx_attr", ctypes.c_void_p), ("ep_attr", ctypes.POINTER(_EpAttr)),
    ("domain_attr", ctypes.POINTER(_DomainAttr)), ("fabric_attr", ctypes.POINTER(_FabricAttr)),
]


def _sockaddr(ptr: int | None, length: int) -> str:
    if not ptr or length < 2:
        return ""
    raw = ctypes.string_at(ptr, length)
    fam = int.from_bytes(raw[:2], sys.byteorder)
    if fam == socket.AF_INET and length >= 8:
        return socket.inet_ntop(socket.AF_INET, raw[4:8])
    if fam == socket.AF_INET6 and length >= 24:
        return socket.inet_ntop(socket.AF_INET6, raw[8:24])
    return f"family {fam}"


def rdm_domains(libfabric: str) -> dict[str, list[tuple[str, str]]]:
    """provider -> [(domain, source address)] for the hints NIXL's plugin discovers
    devices with (ai-dynamo/nixl src/utils/libfabric/libfabric_common.cpp,
    getAvailableNetworkDevices: FI_MSG|FI_RMA, FI_LOCAL_COMM|FI_REMOTE_COMM, FI_EP_RDM,
    FI_CONTEXT, FI_VERSION(1, 18)). Loads ``libfabric`` into this process."""
    lib = ctypes.CDLL(libfabric)
    lib.fi_dupinfo.restype = ctypes.POINTER(_Info)  # fi_allocinfo() is fi_dupinfo(NULL)
    lib.fi_dupinfo.argtypes = [ctypes.c_void_p]
    lib.fi_getinfo.argtypes = [ctypes.c_uint32, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint64,
                               ctypes.POINTER(_Info), ctypes.POINTER(ctypes.POINTER(_Info))]
    lib.fi_freeinfo.argtypes = [ctypes.POINTER(_Info)]
    hints = lib.fi_dupinfo(None)
    hints.contents.caps = FI_MSG | FI_RMA | FI_LOCAL_COMM | FI_REMOTE_COMM
    hints.contents.mode = FI_CONTEXT
    hints.contents.ep_attr.contents.type = FI_EP_RDM
    hints.contents.domain_attr.contents.mr_mode = ~3
    info = ctypes.POINTER(_Info)()
    ret = lib.fi_getinfo(FI_VERSION_1_18, None, None, 0, hints, ctypes.byref(info))
    out: dict[str, list[tuple[str, str]]] = {}
    cur = info
    while not ret and cur:
        i = cur.contents
        prov = (i.fabric_attr.contents.prov_name or b"").decode()
        dom = (i.domain_attr.contents.name or b"").decode()
        out.setdefault(prov, []).append((dom, _sockaddr(i.src_addr, i.src_addrlen)))
        cur = i.next
    if info:
        lib.fi_freeinfo(info)
    lib.fi_freeinfo(hints)
    return out


def check_providers(libfabric: str | None) -> Finding:
    """Which provider and device the plugin would open (it takes the first of cxi, efa,
    tcp, sockets that offers its RDM hints; for tcp/sockets the first domain only)."""
    if not libfabric:
        return Finding("fi-provider", MISSING, "not checked: no usable libfabric", blocking=True)
    try:
        found = rdm_domains(libfabric)
    except (OSError, AttributeError, ValueError) as e:
        return Finding("fi-provider", MISSING, f"fi_getinfo through {libfabric} failed: {e}",
                       blocking=True)
    prov = next((p for p in NIXL_PROVIDERS if found.get(p)), None)
    if prov is None:
        return Finding("fi-provider", MISSING, "no provider the plugin uses (cxi, efa, tcp, sockets) "
                       f"offers FI_EP_RDM with FI_RMA and FI_REMOTE_COMM (found: "
                       f"{', '.join(sorted(found)) or 'none'})",
                       "EFA hosts: the efa provider (EFA installer, efa kernel module); elsewhere "
                       "a libfabric with tcp, and FI_PROVIDER not excluding it", blocking=True)
    doms = found[prov]
    if prov in ("tcp", "sockets") and not doms[0][1]:
        # libfabric gives loopback addresses FI_LOCAL_COMM only (src/common.c,
        # ofi_insert_loopback_addr), so none matches the plugin's FI_REMOTE_COMM and the
        # info comes back without an address: the endpoint has no socket, fi_enable's
        # listen(-1) fails with EBADF ("xnet_listen socket listen failed"). FI_TCP_IFACE
        # picks tcp's interface (ofiwg/libfabric man/fi_tcp.7.md).
        return Finding("fi-provider", MISSING, f"{prov}'s first RDM domain {doms[0][0] or '?'} has no "
                       "address usable for remote peers (only loopback here, or FI_TCP_IFACE=lo): "
                       "the plugin's fi_enable fails with EBADF",
                       "give the host a non-loopback interface (FI_TCP_IFACE may name it)",
                       blocking=True)
    where = doms if prov in ("cxi", "efa") else doms[:1]
    return _ok("fi-provider", f"the plugin would use {prov} on " + ", ".join(
        f"{d} ({a})" if a else d for d, a in where))


def libfabric_checks() -> list[Finding]:
    """Can NIXL's LIBFABRIC backend load on this host, and why not: the plugin, the
    libraries its loader binds (libfabric's ABI, CUDA, hwloc), the provider it would open.
    Uses this process's LD_LIBRARY_PATH, as the engine's loader will."""
    plugin = check_nixl_plugin()
    path = plugin_path()
    libs = plugin_libs(path) if path else None
    if libs is None:
        return [plugin]
    abi = check_libfabric_abi(libs)
    lf = libs.paths.get("libfabric.so.1") if abi.status == OK else None
    return [plugin, abi, check_cuda_libs(libs), check_plugin_hwloc(libs), check_providers(lf)]


def check_efa_devices(sysfs: str = "/sys/class/infiniband") -> Finding:
    devs = []
    for d in sorted(glob.glob(os.path.join(sysfs, "*"))):
        drv = os.path.join(d, "device", "driver")
        name = os.path.basename(d)
        if "efa" in name or (os.path.islink(drv) and os.path.basename(os.readlink(drv)) == "efa"):
            devs.append(name)
    if devs:
        return _ok("efa-devices", f"{len(devs)} EFA device(s): {', '.join(devs)}")
    fi_info = shutil.which("fi_info")
    if fi_info:
        r = subprocess.run([fi_info, "-p", "efa"], capture_output=True, text=True, timeout=20)
        if r.returncode == 0 and "provider: efa" in r.stdout:
            return _ok("efa-devices", "fi_info -p efa lists the efa provider")
    return Finding("efa-devices", MISSING, f"no EFA device in {sysfs} and `fi_info -p efa` "
                   "shows none", "launch on an EFA-enabled instance (trn2/p5en) with EFA "
                   "interfaces attached and the efa kernel module loaded", blocking=True)


def check_shm(colocated: bool, env: Mapping[str, str]) -> Finding:
    v = env.get("FI_EFA_ENABLE_SHM_TRANSFER")
    if not colocated:
        return _ok("efa-shm", "P and D on separate instances; FI_EFA_ENABLE_SHM_TRANSFER "
                   f"{'unset' if v is None else '=' + v}")
    if v == "0":
        return _ok("efa-shm", "FI_EFA_ENABLE_SHM_TRANSFER=0 (required with P and D on one instance)")
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
    return _ok("fi-hmem", detail)


def run_checks(colocated: bool = False, env: Mapping[str, str] | None = None) -> list[Finding]:
    """All findings. None of them initialises the Neuron runtime."""
    env = os.environ if env is None else env
    checks: list[Callable[[], Finding]] = [
        check_libnrt, check_libfabric, check_hwloc, check_efa_devices,
        lambda: check_shm(colocated, env), lambda: check_hmem(env), lambda: check_map_hbm(env),
    ]
    return [c() for c in checks] + libfabric_checks()


def blocking(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.blocking and f.status != OK]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvferry.neuron.envcheck", description=__doc__)
    ap.add_argument("--colocated", action="store_true",
                    help="prefill and decode engines share this instance")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--libfabric", action="store_true",
                    help="only whether NIXL's LIBFABRIC backend can load here (any provider)")
    args = ap.parse_args(argv)
    findings = libfabric_checks() if args.libfabric else run_checks(args.colocated)
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
