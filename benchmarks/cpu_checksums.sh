#!/usr/bin/env bash
# The CPU run of benchmarks/checksum_cost.py (the 2-core machine, the project's venv): for
# each MODE (off, sample, all) `kvferry up --kv-checksums MODE` on the embedded tiny Qwen3
# (real vLLM CPU engines, P and D on their own cores), then N one-at-a-time pulled (or,
# with TRANSFER=push, pushed) requests of INPUT_LEN random tokens through the router.
# usage: N=10 INPUT_LEN=16384 [TRANSFER=push] bash benchmarks/cpu_checksums.sh off sample all
set -uo pipefail
N=${N:-10} INPUT_LEN=${INPUT_LEN:-16384} OUTD=${OUTD:-benchmarks/results}
OUTF=$OUTD/kv_checksums-cpu-$(date +%Y%m%d).jsonl LOGS=${LOGS:-/tmp/cpu_checksums}
mkdir -p "$LOGS"
export KVFERRY_COMMIT=${KVFERRY_COMMIT:-$(git rev-parse --short HEAD)}
source benchmarks/lib.sh
for MODE in "$@"; do
  .venv/bin/kvferry up --max-model-len $((INPUT_LEN + 512)) --kv-checksums "$MODE" > "$LOGS/up-$MODE.log" 2>&1 &
  UPPID=$!
  if ! wait_up; then echo "stack $MODE did not come up"; tail -30 "$LOGS/up-$MODE.log"; stop_stack; continue; fi
  .venv/bin/python benchmarks/checksum_cost.py --checksums "$MODE" --transfer "${TRANSFER:-pull}" \
    --input-len "$INPUT_LEN" --n "$N" --vocab-size 1024 --model tiny-qwen3 --hardware cpu --out "$OUTF" 2>&1 | tail -3
  stop_stack
done
