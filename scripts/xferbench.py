"""Transfer micro-benchmark: kvferry's transport vs a torch peer copy, same run.

Two processes, one GPU each (cuda:0 = P, the READ target; cuda:1 = D, the initiator),
holding a vLLM-0.26-FlashAttention-shaped KV cache: per layer (num_blocks, kv_heads,
block_size, 2*head_dim). D READs 4 / 64 / 1024 contiguous blocks of every layer through
`Transport` (runs merged into one descriptor per layer), also once unmerged (one
descriptor per block and layer) to show what merging buys. The baseline is torch copying
the same slices GPU0 -> GPU1 (peer copy over NVLink) in one process.

`--one-gpu` puts both processes on GPU 0 (UCX cuda_ipc within one device, no torch
baseline), `--op write` moves the blocks the other way as a push WRITE, and
`--unmerged-max` raises the block count also moved one descriptor per block and layer:
what a WRITE costs when vLLM's block ids on P and D do not advance together.

    python -m kvferry.scripts.xferbench --out benchmarks/results/transfer-h200x2-DATE.jsonl

Also runs on CPU (`--device cpu`, DRAM, small sizes) as a smoke test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any

LAYERS, HEADS, BLOCK, HEAD_DIM = 64, 8, 16, 128  # qwen3-32b-shaped K/V, 16-token blocks


def _caches(torch: Any, device: str, num_blocks: int, layers: int, fill: bool) -> dict[str, Any]:
    caches = {}
    for i in range(layers):
        t = torch.empty(num_blocks, HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16, device=device)
        if fill:
            t.normal_()
        else:
            t.zero_()
        caches[f"layer.{i}"] = t
    return caches


def _backend(device: str):
    from kvferry.connectors.memory.backends import CpuBackend, CudaBackend

    return CpuBackend() if device == "cpu" else CudaBackend()


def _target(conn, device: str, num_blocks: int, layers: int, fill: bool = True) -> None:
    import torch

    from kvferry.connectors.transfer.transport import Transport

    if device != "cpu":
        torch.cuda.set_device(0)
        device = "cuda:0"
    torch.manual_seed(0)
    caches = _caches(torch, device, num_blocks, layers, fill=fill)
    layout = _backend(device).describe(caches, num_blocks, BLOCK)
    tp = Transport(layout, name="xfer-target")
    conn.send((tp.metadata(), layout.to_wire()))
    while (ids := conn.recv()) != "done":  # blocks whose checksums D wants
        conn.send([float(c[ids].float().sum()) for c in caches.values()])
    tp.close()


def _log(msg: str) -> None:
    print(f"[xferbench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _emit(out: str, row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def _recv(conn, proc, timeout: float = 120.0):
    """Pipe receive that fails instead of hanging when the other process died or stalls."""
    deadline = time.monotonic() + timeout
    while not conn.poll(1.0):
        if not proc.is_alive():
            raise RuntimeError(f"target process exited with {proc.exitcode}")
        if time.monotonic() > deadline:
            raise TimeoutError("target process did not answer")
    return conn.recv()


def _time_transfers(tp, peer, ids: list[int], iters: int, merge: bool, timeout: float = 30.0,
                    lanes: int = 1, op: str = "READ") -> tuple[list[float], Any]:
    times, xfer = [], None
    for i in range(iters + 2):
        t0 = time.perf_counter()
        xfer = tp.start(op, peer, ids, ids, merge=merge, lanes=lanes)
        while tp.poll(xfer) == "PROC":
            if time.perf_counter() - t0 > timeout:
                tp.release(xfer)
                raise TimeoutError(f"{op} of {len(ids)} blocks not done after {timeout}s")
        if xfer.state != "DONE":
            raise RuntimeError(f"{op} ended {xfer.state}")
        if i >= 2:  # two warm-ups
            times.append(time.perf_counter() - t0)
    return times, xfer


def _peer_copy(torch: Any, num_blocks: int, layers: int, counts: list[int], iters: int) -> dict[int, float]:
    src = _caches(torch, "cuda:0", num_blocks, layers, fill=True)
    dst = _caches(torch, "cuda:1", num_blocks, layers, fill=False)
    out = {}
    for n in counts:
        ts = []
        for i in range(iters + 2):
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            t0 = time.perf_counter()
            with torch.cuda.device(1):
                for s, d in zip(src.values(), dst.values(), strict=True):
                    d[:n].copy_(s[:n], non_blocking=True)
            torch.cuda.synchronize(1)
            if i >= 2:
                ts.append(time.perf_counter() - t0)
        out[n] = statistics.median(ts)
    del src, dst
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--blocks", default="4,64,1024")
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="")
    ap.add_argument("--lanes", default="1", help="comma list: concurrent NIXL requests per READ")
    ap.add_argument("--hardware", default="h200x2")
    ap.add_argument("--one-gpu", action="store_true",
                    help="both processes on GPU 0 (UCX cuda_ipc within one device)")
    ap.add_argument("--op", default="read", choices=["read", "write"],
                    help="write: the initiator WRITEs its blocks into the target's")
    ap.add_argument("--unmerged-max", type=int, default=64,
                    help="the largest block count also moved one descriptor per block and layer")
    args = ap.parse_args(argv)
    op = args.op.upper()
    counts = [int(x) for x in args.blocks.split(",")]
    lane_list = [int(x) for x in args.lanes.split(",")]

    import torch
    import torch.multiprocessing as mp

    from kvferry.connectors.memory.backends import KVLayout
    from kvferry.connectors.transfer.transport import Transport

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(there, args.device, args.num_blocks, args.layers,
                                             op == "READ"))
    proc.start()
    _log("target started")
    dev = "cpu" if args.device == "cpu" else "cuda:0" if args.one_gpu else "cuda:1"
    if dev != "cpu":
        torch.cuda.set_device(dev)
    caches = _caches(torch, dev, args.num_blocks, args.layers, fill=op == "WRITE")
    layout = _backend(dev).describe(caches, args.num_blocks, BLOCK)
    tp = Transport(layout, name="xfer-initiator")
    _log(f"initiator registered {len(layout.regions)} regions")
    meta, wire = _recv(here, proc)
    peer = tp.add_peer("target", meta, KVLayout.from_wire(wire))
    _log("peer added")

    results: list[dict[str, Any]] = []
    commit = os.environ.get("KVFERRY_COMMIT", "")
    command = " ".join(["python", "-m", "kvferry.scripts.xferbench", *(argv or sys.argv[1:])])
    model = {64: "qwen3-32b-kv", 36: "qwen3-8b-kv", 28: "qwen3-0.6b-kv"}.get(  # 8 KV heads x 128
        args.layers, f"kv-{args.layers}-layers")
    base = {"experiment": "transfer", "hardware": args.hardware, "model": model,
            "layers": args.layers, "block_tokens": BLOCK, "same_device": args.one_gpu,
            "command": command, "commit": commit,
            "date": datetime.date.today().isoformat()}
    ok = True
    for n in counts:
        ids = list(range(n))
        for merge, lanes in [(True, x) for x in lane_list] + [(False, 1)]:
            if not merge and n > args.unmerged_max:
                continue  # unmerged 1024-block reads: 131k descriptors, minutes; 64 shows the point
            if op == "WRITE" and lanes > 1:
                continue  # a WRITE is one request (Transport.start): lanes are READs only
            _log(f"{op} {n} blocks merge={merge} lanes={lanes}")
            times, xfer = _time_transfers(tp, peer, ids, args.iters if merge else 3, merge,
                                          lanes=lanes, op=op)
            med = statistics.median(times)
            verb = "pull" if op == "READ" else "push"
            mode = verb if lanes == 1 else f"{verb}_lanes{lanes}"
            row = {**base, "impl": "kvferry", "mode": mode if merge else f"{verb}_unmerged",
                   "lanes": lanes, "blocks": n, "bytes": xfer.nbytes, "descriptors": xfer.ndesc,
                   "ms_p50": round(med * 1e3, 3), "gbps": round(xfer.nbytes / med / 1e9, 1)}
            results.append(row)
            _emit(args.out, row)
        here.send(ids)
        want = _recv(here, proc)
        got = [float(c[ids].float().sum()) for c in caches.values()]
        same = all(abs(a - b) <= 1e-3 * max(1.0, abs(a)) for a, b in zip(want, got, strict=True))
        ok &= same
        _log(f"{n} blocks: data {'OK' if same else 'MISMATCH'}")
    here.send("done")
    proc.join(timeout=60)
    tp.close()
    del caches
    if args.device != "cpu" and not args.one_gpu:
        torch.cuda.empty_cache()
        _log("torch peer copy")
        peer_times = _peer_copy(torch, args.num_blocks, args.layers, counts, args.iters)
        for n, med in peer_times.items():
            nbytes = n * args.layers * HEADS * BLOCK * 2 * HEAD_DIM * 2
            row = {**base, "impl": "torch", "mode": "peer_copy", "blocks": n, "bytes": nbytes,
                   "ms_p50": round(med * 1e3, 3), "gbps": round(nbytes / med / 1e9, 1)}
            results.append(row)
            _emit(args.out, row)
        for n in counts:
            t = next(r for r in results if r["mode"] == "peer_copy" and r["blocks"] == n)
            for k in (r for r in results if r["impl"] == "kvferry" and r["blocks"] == n):
                print(f"{n:5d} blocks {k['mode']:>14}: kvferry {k['gbps']:7.1f} GB/s  torch peer copy "
                      f"{t['gbps']:7.1f} GB/s  ratio {k['gbps'] / t['gbps']:.2f}")
    print("DATA OK" if ok else "DATA MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
