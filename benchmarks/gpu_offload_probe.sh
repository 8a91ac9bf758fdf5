#!/usr/bin/env bash
# The one-GPU run of benchmarks/offload_probe.py (the device machine, GPU kit in .kit, shared
# gpukit README): vLLM's own CPU offloading on one engine, qwen3-8b shape, dummy weights.
# usage: KVFERRY_COMMIT=<commit> bash benchmarks/gpu_offload_probe.sh [probe args...]
set -uo pipefail
bash .kit/install.sh .kit >/dev/null || exit 9
source /tmp/kit-site/kit-env.sh
mkdir -p /tmp/kvpkg/kvferry
for t in connectors router neuron scripts; do ln -sfn "$PWD/$t" /tmp/kvpkg/kvferry/$t; done
export PYTHONPATH=/tmp/kvpkg:$PYTHONPATH PYTHONUNBUFFERED=1
M=/tmp/m8b; [ -d $M ] || python3 -m kvferry.scripts.cli model --shape qwen3-8b $M >/dev/null || exit 6
HW=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H200 && echo h200x1 || echo h100x1)
python3 benchmarks/offload_probe.py --model-dir $M --hardware $HW \
  --out "$OUT/kv_tiers-$HW-$(date +%Y%m%d).jsonl" --log "$OUT/offload_probe_engine.log" "$@"
