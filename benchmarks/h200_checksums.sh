#!/usr/bin/env bash
# The one-GPU (H200 or H100) run of benchmarks/checksum_cost.py: one GPU (the device machine), the GPU kit in
# .kit (shared gpukit README). For each MODE (off, sample, all) `kvferry up --share-device
# 12 --kv-checksums MODE` on a qwen3-8b shape (dummy weights), then N one-at-a-time (pulled, or pushed with TRANSFER=push)
# requests of 16k random tokens through the router; one result line per mode.
# usage: KVFERRY_COMMIT=<commit> N=20 [TRANSFER=push] bash benchmarks/h200_checksums.sh off all sample
set -uo pipefail
bash .kit/install.sh .kit >/dev/null || exit 9
source /tmp/kit-site/kit-env.sh
mkdir -p /tmp/kvpkg/kvferry
for t in connectors router neuron scripts; do ln -sfn "$PWD/$t" /tmp/kvpkg/kvferry/$t; done
export PYTHONPATH=/tmp/kvpkg:$PYTHONPATH PYTHONUNBUFFERED=1
M=/tmp/m8b; [ -d $M ] || python3 -m kvferry.scripts.cli model --shape qwen3-8b $M >/dev/null || exit 6
N=${N:-20}
# the card the device lent (H100 or H200), for the result's hardware field
HW=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H200 && echo h200x1 || echo h100x1)
OUTF=$OUT/kv_checksums-$HW-$(date +%Y%m%d).jsonl
wait_up() { for i in $(seq 1 400); do
  curl -sf localhost:8100/health >/dev/null && curl -sf localhost:8200/health >/dev/null && curl -sf localhost:8000/health >/dev/null && return 0; sleep 1; done; return 1; }
stop() { kill -INT $UPPID 2>/dev/null; for i in $(seq 1 40); do kill -0 $UPPID 2>/dev/null || break; sleep 1; done; kill -9 $UPPID 2>/dev/null
  for p in 8000 8100 8200; do fuser -k $p/tcp 2>/dev/null; done; sleep 3; }
for MODE in "$@"; do
  t0=$(date +%s)
  python3 -m kvferry.scripts.cli up --hardware-backend cuda --share-device 12 --model $M \
    --max-model-len 20000 --kv-checksums $MODE > $OUT/up-$MODE.log 2>&1 &
  UPPID=$!
  if ! wait_up; then echo "stack $MODE did not come up"; tail -30 $OUT/up-$MODE.log; stop; continue; fi
  echo "stack $MODE up in $(( $(date +%s) - t0 )) s"
  python3 benchmarks/checksum_cost.py --checksums $MODE --transfer ${TRANSFER:-pull} --input-len 16384 --n $N \
    --model qwen3-8b --hardware $HW --out $OUTF 2>&1 | tail -3
  stop
done
grep -h "checksum" $OUT/up-*.log 2>/dev/null | grep -iv "^INFO" | tail -5
ls -la $OUT
