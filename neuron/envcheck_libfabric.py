"""Can NIXL's LIBFABRIC backend be created on this host at all, and why not?

``python -m kvferry.neuron.envcheck --libfabric`` answers from these checks alone: the
plugin NIXL would load, the libraries its loader binds (libfabric's FABRIC_1.10 ABI,
libcuda/libcudart, hwloc) and the provider and device it would open (any provider: tcp in
CI, efa on trn2/p5en). Nothing here needs Neuron: the Trainium host checks
(libnrt, EFA devices, SHM, HMEM) are in :mod:`kvferry.neuron.envcheck`.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .findings import MISSING, OK, Finding, passed


# -- is the plugin there, and does its loader resolve it? ------------------------------------
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
    return passed("nixl-libfabric", plugin)


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
        return passed("libfabric-abi", "the plugin does not link libfabric.so.1")
    if path is None:
        return Finding("libfabric-abi", MISSING, "libfabric.so.1 not found by the plugin's loader",
                       fix, blocking=True)
    lacking = sorted(v for v, ok in need.items() if not ok)
    if lacking:
        return Finding("libfabric-abi", MISSING, f"{path} lacks {', '.join(lacking)} (the plugin "
                       f"needs {', '.join(sorted(need))})", fix, blocking=True)
    return passed("libfabric-abi", f"{path} exports {', '.join(sorted(need)) or 'what the plugin needs'}")


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
    return passed("cuda-libs", ", ".join(f"{k} => {v}" for k, v in sorted(cuda.items())) or "none linked")


def check_plugin_hwloc(libs: PluginLibs) -> Finding:
    path = libs.paths.get("libhwloc.so.15", "")
    if path is None:
        return Finding("plugin-hwloc", MISSING, "libhwloc.so.15 not found by the plugin's loader "
                       "(it maps NICs to NUMA nodes and accelerators)", "apt install libhwloc15",
                       blocking=True)
    return passed("plugin-hwloc", path or "not linked")


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
    return passed("fi-provider", f"the plugin would use {prov} on " + ", ".join(
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
