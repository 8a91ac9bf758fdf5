"""Undo vLLM's NixlConnector moving a CPU engine's compute thread onto another core.

On the CPU platform, vLLM's NIXL worker (vllm/distributed/kv_transfer/kv_connector/v1/nixl/
base_worker.py, ``NixlConnectorWorker.__init__``, vLLM 0.32) calls
``os.sched_setaffinity(0, [last core of each NUMA node])`` "to reserve different cores for
start_load_kv() from model_forward()". Called from the worker's main thread, it moves the
thread that is also the OpenMP master, i.e. the forward pass, onto the host's last core,
whatever ``VLLM_CPU_OMP_THREADS_BIND`` said. Every vllm-nixl engine on a host then computes
on that one core: on a 2-core machine P's forward ran on D's core, next to D's worker
threads that spin between steps, and a 300-token first request took 35-60 s; D's handshake
to P (a 5 s ZMQ receive timeout in the same file) then failed now and then (HTTP 500).

kvferry's connector does not do this. For vllm-nixl engines it launches (`kvferry up`, the
tests' stacks), :func:`restore_worker_binding` puts each worker's main thread back on the
cores its bind string gives its rank, once the engine answers /health (the connector has
been built by then).
"""

from __future__ import annotations

import os
import re

import psutil

from .procs import Child

_WORKER = re.compile(r"VLLM::Worker(?:\S*?_TP(\d+))?")


def parse_ranges(text: str) -> set[int]:
    """"0-2,5" -> {0, 1, 2, 5} (vLLM's VLLM_CPU_OMP_THREADS_BIND syntax, one rank)."""
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def workers(child: Child) -> dict[int, int]:
    """pid -> TP rank of `child`'s vLLM worker processes (their titles: VLLM::Worker[_TPr])."""
    out: dict[int, int] = {}
    if child.proc is None:
        return out
    for proc in psutil.Process(child.proc.pid).children(recursive=True):
        try:
            m = _WORKER.match(" ".join(proc.cmdline()))
        except psutil.Error:
            continue
        if m is not None:
            out[proc.pid] = int(m.group(1) or 0)
    return out


def restore_worker_binding(child: Child) -> dict[int, set[int]]:
    """Re-bind the main thread of each of `child`'s vLLM workers to its rank's cores (from
    the child's ``VLLM_CPU_OMP_THREADS_BIND``). Returns worker pid -> the cores its main
    thread was on before, for the workers that had been moved."""
    bind = child.env.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if not bind or bind in ("auto", "nobind"):
        return {}
    ranks = [parse_ranges(part) for part in bind.split("|")]
    moved: dict[int, set[int]] = {}
    for pid, rank in workers(child).items():
        if rank >= len(ranks):
            continue
        # The main thread's id is the process id; sched_setaffinity(pid) sets that thread's.
        was = os.sched_getaffinity(pid)
        if was != ranks[rank]:
            os.sched_setaffinity(pid, ranks[rank])
            moved[pid] = was
    return moved
