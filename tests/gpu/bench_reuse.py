"""Multi-turn reuse benchmark driver (one device call): turn-2 TTFT with D->P reuse on vs
off through kvferry's router, then a P that keeps its own prefix cache (the local-hit
ideal), same conversations; JSON lines (bench-schema) go to --out.

Per history size S: turn 1 = S tokens, turn 2 = turn 1 + D's answer + --new-tokens (512),
the agent pattern (a long history, a short new message). P runs with prefix caching off
(it evicted the history, or it is another P), so without reuse it recomputes it all.
Warm-up conversations use other prompts, so no cache holds a measured prompt beforehand.

    python tests/gpu/bench_reuse.py --shape qwen3-8b --history 2048,8192,16384,24576 \
        --out $OUT/bidirectional-h200x2-DATE.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stack import pd_stack  # noqa: E402

from kvferry.scripts.modelgen import SHAPES, write_model  # noqa: E402


def stream_turn(router: str, model: str, toks: list[int], out_len: int, cid: str | None,
                mode: str) -> tuple[float, list[int], int]:
    """(TTFT ms, output token ids, reused tokens) of one streamed turn."""
    body = {"model": model, "prompt": toks, "max_tokens": out_len, "min_tokens": out_len,
            "temperature": 0, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    if cid:
        body["conversation_id"] = cid
    t0 = time.perf_counter()
    ttft, out, reused = None, [], 0
    with httpx.stream("POST", router + "/v1/completions", json=body, timeout=300,
                      headers={"x-kvferry-mode": mode}) as r:
        r.raise_for_status()
        reused = int(r.headers.get("x-kvferry-reused-tokens", "0"))
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            reused = int(ev.get("kvferry_reused_tokens", reused))
            for ch in ev.get("choices", []):
                if ttft is None and (ch.get("text") or ch.get("token_ids")):
                    ttft = (time.perf_counter() - t0) * 1e3
                out += ch.get("token_ids") or []
    return ttft or float("nan"), out, reused


def conversation(router: str, model: str, sizes: list[int], out_len: int, seed: int,
                 cid: str | None, mode: str, vocab: int) -> list[dict]:
    rnd = random.Random(seed)
    toks: list[int] = []
    rows = []
    for t, size in enumerate(sizes, 1):
        toks = toks + [rnd.randrange(100, vocab - 100) for _ in range(max(size - len(toks), 16))]
        ttft, out, reused = stream_turn(router, model, toks, out_len, cid, mode)
        rows.append({"turn": t, "input_len": len(toks), "ttft_ms": ttft, "out": out,
                     "reused_tokens": reused})
        toks = toks + (out or [rnd.randrange(100, vocab - 100) for _ in range(out_len)])
    return rows


def run_mode(router: str, args, label: str, use_cid: bool, mode: str, seed0: int
             ) -> dict[int, list[list[dict]]]:
    """For each history size S: conversations of two turns, S tokens then S + answer +
    --new-tokens; returns {S: [turn rows per conversation]}."""
    out: dict[int, list[list[dict]]] = {}
    for si, size in enumerate(args.sizes):
        out[size] = []
        for c in range(args.conversations):
            cid = f"{label}-{size}-{c}-{os.getpid()}" if use_cid else None
            sizes = [size, size + args.output_len + args.new_tokens]
            rows = conversation(router, args.model_path, sizes, args.output_len,
                                seed0 + 100 * si + c, cid, mode, SHAPES[args.shape].vocab_size)
            out[size].append(rows)
            print(label, size, c, [(r["input_len"], round(r["ttft_ms"], 1), r["reused_tokens"])
                                   for r in rows], flush=True)
    return out


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:
        return os.environ.get("KVFERRY_COMMIT", "unknown")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--history", default="2048,8192,16384,24576",
                    help="turn-1 prompt sizes; turn 2 adds the answer and --new-tokens")
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--mode", default="push", choices=("push", "pull"))
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--hardware", default="h200x2")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    args.sizes = [int(x) for x in args.history.split(",")]
    tmp = Path(tempfile.mkdtemp())
    args.model_path = str(write_model(tmp / args.shape, args.shape))
    common: tuple[str, ...] = ("--max-model-len", str(max(args.sizes) + 2048))
    if args.backend == "cuda":
        common += ("--gpu-memory-utilization", "0.85")
    results: dict[str, dict[int, list[list[dict]]]] = {}
    t0 = time.monotonic()
    with pd_stack(args.model_path, tmp / "logs", backend=args.backend, engine_args=common,
                  prefill_args=("--no-enable-prefix-caching",)) as s:
        print(f"stack up in {time.monotonic() - t0:.0f}s", flush=True)
        run_mode(s.router, args, "warmup", True, args.mode, 90_000)  # other prompts
        results["reuse_on"] = run_mode(s.router, args, "reuse_on", True, args.mode, 1000)
        results["reuse_off"] = run_mode(s.router, args, "reuse_off", False, args.mode, 1000)
        lines = [ln for ln in s.prefill.log().splitlines() if "reuse READ" in ln]
        print("prefill", len(lines), "reuse READs; last:", lines[-2:], flush=True)
    t0 = time.monotonic()
    # The ideal: a P whose own prefix cache still holds the history (same prompts; it has
    # seen only the earlier turns of each conversation).
    with pd_stack(args.model_path, tmp / "logs-local", backend=args.backend,
                  engine_args=common) as s:
        print(f"local-hit stack up in {time.monotonic() - t0:.0f}s", flush=True)
        run_mode(s.router, args, "warmup-local", False, args.mode, 90_000)
        results["local_hit"] = run_mode(s.router, args, "local_hit", False, args.mode, 1000)

    cmd = "python tests/gpu/bench_reuse.py " + " ".join(sys.argv[1:])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        for mode, by_size in results.items():
            for size, convs in by_size.items():
                for ti in range(2):
                    rows = [conv[ti] for conv in convs]
                    offs = [conv[ti] for conv in results["reuse_off"][size]]
                    ttfts = sorted(r["ttft_ms"] for r in rows)
                    f.write(json.dumps({
                        "experiment": "bidirectional", "impl": "kvferry", "mode": mode,
                        "transfer_mode": args.mode, "hardware": args.hardware,
                        "model": args.shape, "turn": ti + 1, "history_len": size,
                        "input_len": rows[0]["input_len"], "new_tokens": args.new_tokens,
                        "output_len": args.output_len, "qps": 0, "n": len(rows),
                        "ttft_ms_p50": round(statistics.median(ttfts), 3),
                        "ttft_ms_p90": round(ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))], 3),
                        "reused_tokens": int(statistics.median(r["reused_tokens"] for r in rows)),
                        "outputs_match": all(r["out"] == o["out"]
                                             for r, o in zip(rows, offs, strict=True)),
                        "command": cmd, "commit": commit(),
                        "date": date.today().isoformat()}) + "\n")
    print(Path(args.out).read_text(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
