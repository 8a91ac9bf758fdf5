"""Build the libfabric that NIXL 1.5.1's LIBFABRIC plugin loads on a CPU host (idempotent).

The nixl-cu12/cu13 1.5.1 wheels' ``libplugin_LIBFABRIC.so`` imports ``fi_getinfo``,
``fi_dupinfo`` and ``fi_freeinfo`` at version FABRIC_1.10, which no tagged libfabric
release (up to v2.6.0) exports, and NEEDS ``libcuda.so.1`` and ``libcudart.so.12|13``.
So this builds libfabric from the vendored ofiwg/libfabric snapshot (tcp, sockets and shm
providers only) and two no-op CUDA stubs, as AWS's Neuron images give that plugin a
``libcuda.so.1`` stub (aws-neuron/aws-neuron-eks-samples disagg_serve_vllm/
prefill-deploy.yaml). libhwloc.so.15 comes from the distribution (Debian: libhwloc15).

Output: ``<opt>/libfabric-<key>/`` with ``lib/libfabric.so.1``, ``bin/fi_info``,
``stubs/libcuda.so.1``, ``stubs/libcudart.so.{12,13}`` and ``build.json``; ``<key>`` hashes
the tarball and this recipe, so a cached build is reused until either changes.
tests/libfabric_host.py finds it the same way.

Usage: python .ci/build_libfabric.py [--vendor DIR] [--opt DIR]
Default DIR: ../shared/vendor and .venv/opt. Prints the prefix; exits 2 without the vendor
tarball (nothing to build), 1 when the build fails (the log's tail is printed).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Newest of the vendored snapshots. All four (c459d6a51, 1fb1f4769, 739bccbba, af8ddbe92)
# export FABRIC_1.10 and give every struct the plugin touches the same layout (offsetof
# compared; their include/rdma changes only append ops-table slots), and both c459d6a51
# and af8ddbe92 were run with the plugin.
SNAPSHOT = "libfabric-af8ddbe92.tar.gz"
CONFIGURE = ("--enable-only", "--enable-tcp", "--enable-sockets", "--enable-shm",
             "--disable-static", "--with-cuda=no", "--with-neuron=no")
# The CUDA symbols the plugin imports (objdump -T); none is called for DRAM. Returning 0
# with outputs untouched is what AWS's libcuda stub does (memory type stays "host").
CUDA_STUB = """\
int cuCtxSetCurrent(void *ctx) { return 0; }
int cuDeviceGetPCIBusId(char *s, int len, int dev) { if (s && len) s[0] = 0; return 0; }
int cuPointerGetAttributes(unsigned n, void *attrs, void **data, unsigned long long p) { return 0; }
"""
CUDART_STUB = """\
const char *cudaGetErrorString(int e) { return "kvferry libcudart stub: no CUDA runtime"; }
int cudaSetDevice(int dev) { return 100; /* cudaErrorNoDevice */ }
"""
CUDART_MAJORS = (12, 13)  # nixl_cu12 / nixl_cu13 plugins import @libcudart.so.<major>
STAMP = "build.json"


def default_vendor() -> Path:
    return ROOT.parent / "shared" / "vendor"


def default_opt() -> Path:
    return ROOT / ".venv" / "opt"


def key(tarball: Path) -> str:
    h = hashlib.sha256(tarball.read_bytes())
    h.update(repr((CONFIGURE, CUDA_STUB, CUDART_STUB, CUDART_MAJORS)).encode())
    return h.hexdigest()[:12]


def prefix_for(tarball: Path, opt: Path) -> Path:
    return opt / f"libfabric-{key(tarball)}"


def built(prefix: Path) -> bool:
    return (prefix / STAMP).is_file()


def _run(cmd: list[str], cwd: Path, log: Path) -> None:
    with log.open("ab") as f:
        f.write(f"\n$ {' '.join(cmd)}\n".encode())
        f.flush()
        subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, check=True)


def build_stubs(dest: Path, log: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "cuda_stub.c").write_text(CUDA_STUB)
    (dest / "cudart_stub.c").write_text(CUDART_STUB)
    _run(["cc", "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o", "libcuda.so.1",
          "cuda_stub.c"], dest, log)
    for major in CUDART_MAJORS:
        soname = f"libcudart.so.{major}"
        # the plugin binds cudaSetDevice@libcudart.so.<major>: a version node of that name
        (dest / f"{soname}.map").write_text(
            f"{soname} {{ global: cudaGetErrorString; cudaSetDevice; local: *; }};\n")
        _run(["cc", "-shared", "-fPIC", "-O1", f"-Wl,-soname,{soname}",
              f"-Wl,--version-script={soname}.map", "-o", soname, "cudart_stub.c"], dest, log)


def build(tarball: Path, prefix: Path, jobs: int = 2) -> float:
    """Unpack, configure, make, install into ``prefix``; returns the seconds it took."""
    missing = [t for t in ("autoreconf", "automake", "libtoolize", "make", "cc")
               if shutil.which(t) is None]
    if missing:
        raise RuntimeError(f"missing build tools: {', '.join(missing)} "
                           "(apt-get install autoconf automake libtool make gcc)")
    t0 = time.monotonic()
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix.name + ".", dir=prefix.parent))
    log = prefix.parent / f"{prefix.name}.log"
    log.write_text("")
    try:
        with tarfile.open(tarball) as tf:
            tf.extractall(tmp / "src", filter="data")
        (src,) = (tmp / "src").iterdir()
        stage = tmp / "prefix"
        _run(["./autogen.sh"], src, log)
        _run(["./configure", "-q", f"--prefix={prefix}", *CONFIGURE], src, log)
        _run(["make", f"-j{jobs}", "-s"], src, log)
        # installed under its final path (libtool bakes it in), staged by DESTDIR
        _run(["make", "-s", "install", f"DESTDIR={stage}"], src, log)
        out = stage / prefix.relative_to("/")
        build_stubs(out / "stubs", log)
        secs = time.monotonic() - t0
        (out / STAMP).write_text(json.dumps({
            "snapshot": tarball.name, "sha256": hashlib.sha256(tarball.read_bytes()).hexdigest(),
            "configure": list(CONFIGURE), "cudart_majors": list(CUDART_MAJORS),
            "build_seconds": round(secs, 1)}, indent=1) + "\n")
        if prefix.exists():
            shutil.rmtree(prefix)
        out.rename(prefix)
        return secs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure(vendor: Path, opt: Path, jobs: int = 2) -> Path:
    """The built prefix for ``vendor``'s snapshot, building it first when absent."""
    tarball = vendor / SNAPSHOT
    prefix = prefix_for(tarball, opt)
    opt.mkdir(parents=True, exist_ok=True)
    with open(opt / ".libfabric.lock", "w") as lock:  # one builder at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not built(prefix):
            build(tarball, prefix, jobs)
    return prefix


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vendor", type=Path, default=default_vendor())
    ap.add_argument("--opt", type=Path, default=default_opt())
    ap.add_argument("-j", "--jobs", type=int, default=min(2, os.cpu_count() or 1))
    args = ap.parse_args(argv)
    tarball = args.vendor / SNAPSHOT
    if not tarball.is_file():
        print(f"no {tarball}: nothing to build", file=sys.stderr)
        return 2
    try:
        prefix = ensure(args.vendor, args.opt.resolve(), args.jobs)
    except (subprocess.CalledProcessError, RuntimeError) as e:
        log = prefix_for(tarball, args.opt.resolve()).with_suffix(".log")
        tail = log.read_text(errors="replace").splitlines()[-30:] if log.exists() else []
        print(f"libfabric build failed: {e}", *tail, sep="\n", file=sys.stderr)
        return 1
    print(prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
