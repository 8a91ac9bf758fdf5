#!/usr/bin/env bash
# The one-GPU run of benchmarks/offload_probe.py (the device machine, GPU kit in .kit, shared
# gpukit README): vLLM's own CPU offloading on one engine, qwen3-8b shape, dummy weights.
# usage: KVFERRY_COMMIT=<commit> bash benchmarks/gpu_offload_probe.sh [probe args...]
set -uo pipefail
source benchmarks/lib.sh
gpu_env
M=/tmp/m8b; model_dir qwen3-8b $M
python3 benchmarks/offload_probe.py --model-dir $M --hardware $HW \
  --out "$OUT/kv_tiers-$HW-$(date +%Y%m%d).jsonl" --log "$OUT/offload_probe_engine.log" "$@"
