#!/usr/bin/env bash
# The one-GPU (H200 or H100) run of benchmarks/checksum_cost.py: one GPU (the device machine), the GPU kit in
# .kit (shared gpukit README). For each MODE (off, sample, all) `kvferry up --share-device
# 12 --kv-checksums MODE` on a qwen3-8b shape (dummy weights), then N one-at-a-time (pulled, or pushed with TRANSFER=push)
# requests of 16k random tokens through the router; one result line per mode.
# usage: KVFERRY_COMMIT=<commit> N=20 [TRANSFER=push] bash benchmarks/h200_checksums.sh off all sample
set -uo pipefail
source benchmarks/lib.sh
gpu_env
M=/tmp/m8b; model_dir qwen3-8b $M
N=${N:-20}
OUTF=$OUT/kv_checksums-$HW-$(date +%Y%m%d).jsonl
for MODE in "$@"; do
  t0=$(date +%s)
  python3 -m kvferry.scripts.cli up --hardware-backend cuda --share-device 12 --model $M \
    --max-model-len 20000 --kv-checksums $MODE > $OUT/up-$MODE.log 2>&1 &
  UPPID=$!
  if ! wait_up 400; then echo "stack $MODE did not come up"; tail -30 $OUT/up-$MODE.log; stop_stack; continue; fi
  echo "stack $MODE up in $(( $(date +%s) - t0 )) s"
  python3 benchmarks/checksum_cost.py --checksums $MODE --transfer ${TRANSFER:-pull} --input-len 16384 --n $N \
    --model qwen3-8b --hardware $HW --out $OUTF 2>&1 | tail -3
  stop_stack
done
grep -h "checksum" $OUT/up-*.log 2>/dev/null | grep -iv "^INFO" | tail -5
ls -la $OUT
