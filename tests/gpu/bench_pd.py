"""H200 x2 push-vs-pull benchmark driver: kvferry push, kvferry pull, the prefill engine
serving alone (colocated), then vLLM's built-in NixlConnector (pull) and NixlPushConnector
(push), the latter driven by the same router; same model shape, prompt lengths and rates;
lines go to --out. Engines run with CUDA graphs unless --eager.

    python tests/gpu/bench_pd.py --shape qwen3-0.6b --input-len 4096,16384 --qps 2,8 \
        --out $OUT/push_vs_pull-h200x2-DATE.jsonl
"""

from __future__ import annotations

import argparse
import re
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
           "--hardware", getattr(args, "hardware", "h200x2"), "--model-name", args.shape,
           "--vocab", str(SHAPES[args.shape].vocab_size),
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
        print("push timeline:", push_timeline(s.prefill.log(), s.decode.log()), flush=True)


def push_timeline(p_log: str, d_log: str) -> dict[str, float]:
    """Medians from the connectors' logs: WRITE duration, WRITE done after the prefill
    ended (P), KV in after D registered (D); the rest of the handoff is engine steps."""
    def med(pattern: str, text: str) -> float:
        vals = sorted(float(m) for m in re.findall(pattern, text))
        return vals[len(vals) // 2] if vals else float("nan")
    return {"write_ms": med(r"descriptors, ([\d.]+) ms; done", p_log),
            "write_done_after_prefill_ms": med(r"done ([\d.]+) ms after the prefill", p_log),
            "kv_in_after_register_ms": med(r"KV in, ([\d.]+) ms after registering", d_log)}


def serving_args(input_len: str, qps: str, num_requests: int, budget_s: float
                 ) -> argparse.ArgumentParser:
    """The options every serving driver shares (what `bench` needs)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--input-len", default=input_len)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--qps", default=qps)
    ap.add_argument("--num-requests", type=int, default=num_requests)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=budget_s)
    return ap


ENGINE_ARGS = ("--max-model-len", "20000", "--no-enable-prefix-caching",
               "--gpu-memory-utilization", "0.85")


def main() -> int:
    ap = serving_args("4096,16384", "2,8", 16, 240)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--only-vllm", action="store_true")
    ap.add_argument("--vllm-modes", default="pull,push", help="vLLM connectors to run")
    ap.add_argument("--eager", action="store_true", help="engines without CUDA graphs")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    model = str(write_model(tmp / args.shape, args.shape))
    engine_args = ENGINE_ARGS + (("--enforce-eager",) if args.eager else ())
    if not args.only_vllm:
        run_kvferry(args, model, tmp, engine_args)
    for mode in [] if args.skip_vllm else args.vllm_modes.split(","):
        t0 = time.monotonic()
        with pd_stack(model, tmp / f"logs-vllm-{mode}", connector="vllm-nixl", backend="cuda",
                      engine_args=engine_args, mode=mode) as s:
            print(f"vLLM {mode} stack up in {time.monotonic() - t0:.0f}s", flush=True)
            bench([f"vllm-{mode}={s.router},impl=vllm-0.26.0,mode={mode}"], args, "push_vs_pull")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
