"""FAKE Neuron runtime for the tests: builds tests/fakes/fake_libnrt.c and plays the part
the framework (libtorch-neuronx) plays in a vllm-neuron worker, starting the runtime.

kvferry binds no ``nrt_init``; the tests start the fake runtime through this separate
ctypes handle onto the same library (one dlopen handle, one state), and read the fake's
test-only counters from it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

FAKE_SRC = Path(__file__).parent / "fake_libnrt.c"
NRT_FRAMEWORK_TYPE_PYTORCH = 3  # nrt.h nrt_framework_type_t: what libtorch-neuronx passes


def build(out: Path) -> Path:
    """Compile the fake libnrt to ``out`` (skips the test when there is no gcc).

    -Bsymbolic: tests load private copies with RTLD_GLOBAL next to the shared one, and a
    copy's calls into its own nrt_* functions must not bind to another copy's."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc not found: cannot build the fake libnrt (tests/fakes/fake_libnrt.c)")
    subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-Wl,-Bsymbolic", "-o", str(out),
                    str(FAKE_SRC)], check=True)
    return out


class FakeRuntime:
    """The fake libnrt at ``path``, seen from the framework's side."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        self.lib.nrt_init.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p]
        self.lib.nrt_init.restype = ctypes.c_int

    def start(self, map_hbm: bool = False) -> None:
        """What vllm-neuron's worker does before any connector runs: set
        NEURON_RT_MAP_HBM in its own environment (it sets 1; it stays set) and start the
        runtime (nrt_init, once). Callers guard os.environ (monkeypatch.setenv first)."""
        os.environ["NEURON_RT_MAP_HBM"] = "1" if map_hbm else "0"
        status = self.lib.nrt_init(NRT_FRAMEWORK_TYPE_PYTORCH, b"2.9", b"fake")
        if status != 0:
            raise RuntimeError(f"fake nrt_init returned {status}")

    def reset(self) -> None:
        """Back to a fresh process: no runtime, no tensors, counters at zero."""
        self.lib.fake_nrt_reset()

    @property
    def init_calls(self) -> int:
        return int(self.lib.fake_nrt_init_calls())

    @property
    def live_tensors(self) -> int:
        return int(self.lib.fake_nrt_live_tensors())

    @property
    def hbm_mapped(self) -> bool:
        return bool(self.lib.fake_nrt_hbm_mapped())


def host_readable(addr: int, nbytes: int = 1) -> bool:
    """Is [addr, addr+nbytes) readable host memory in this process (/proc/self/maps)?"""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= addr and addr + nbytes <= hi:
            return perms.startswith("r")
    return False
