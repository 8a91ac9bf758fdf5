"""H200 x2 push-vs-pull benchmark driver (one device call): kvferry push, kvferry pull,
the prefill engine serving alone (colocated), then vLLM's built-in NixlConnector (pull),
all with the same model shape, prompts lengths and rates; lines go to --out.

    python tests/gpu/bench_pd.py --shape qwen3-0.6b --input-len 4096,16384 --qps 2,8 \
        --out $OUT/push_vs_pull-h200x2-DATE.jsonl
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stack import pd_stack  # noqa: E402

from kvferry.scripts.modelgen import SHAPES, write_model  # noqa: E402


def bench(targets: list[str], args, experiment: str) -> None:
    cmd = [sys.executable, "-m", "kvferry.scripts.cli", "bench", "--experiment", experiment,
           "--hardware", "h200x2", "--model-name", args.shape, "--vocab", str(SHAPES[args.shape].vocab_size),
           "--input-len", args.input_len, "--output-len", str(args.output_len), "--qps", args.qps,
           "--num-requests", str(args.num_requests), "--results-dir", str(Path(args.out).parent)]
    for t in targets:
        cmd += ["--target", t]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=False, timeout=args.budget_s)


def run_kvferry(args, model: str, tmp: Path, engine_args: tuple[str, ...]) -> None:
    t0 = time.monotonic()
    with pd_stack(model, tmp / "logs", backend="cuda", engine_args=engine_args) as s:
        print(f"kvferry stack up in {time.monotonic() - t0:.0f}s", flush=True)
        bench([f"kvferry-push={s.router},impl=kvferry,mode=push,x-kvferry-mode=push",
               f"kvferry-pull={s.router},impl=kvferry,mode=pull,x-kvferry-mode=pull",
               f"colocated={s.prefill.url},impl=colocated,mode=colocated"], args, "push_vs_pull")
        for e in (s.prefill, s.decode):
            lines = [ln for ln in e.log().splitlines() if "kvferry WRITE" in ln or "kvferry READ" in ln]
            print(e.role, len(lines), "transfers; last:", lines[-2:], flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--input-len", default="4096,16384")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--qps", default="2,8")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--only-vllm", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    model = str(write_model(tmp / args.shape, args.shape))
    engine_args = ("--max-model-len", "20000", "--no-enable-prefix-caching",
                   "--gpu-memory-utilization", "0.85")
    if not args.only_vllm:
        run_kvferry(args, model, tmp, engine_args)
    if not args.skip_vllm:
        t0 = time.monotonic()
        with pd_stack(model, tmp / "logs-vllm", connector="vllm-nixl", backend="cuda",
                      engine_args=engine_args) as s:
            print(f"vLLM NixlConnector stack up in {time.monotonic() - t0:.0f}s", flush=True)
            bench([f"vllm-pull={s.router},impl=vllm-0.26.0,mode=pull"], args, "push_vs_pull")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
