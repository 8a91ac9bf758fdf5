#!/usr/bin/env bash
# The H200 run of benchmarks/router_dataplane.py: one GPU (the device machine), GPU kit in
# .kit (shared gpukit README), vllm-router (+ orjson, setproctitle) and uvloop wheels in .whl
# and .kit/uvl; for each
# STACK (nixl: vLLM NixlConnector engines, all three impls; kvpull / kvpush: kvferry's
# connector) `kvferry up --share-device 30` on a qwen3-0.6b shape, then the bench.
# (overload: kvferry's router alone at 4x its admission capacity of 64 + 64, then at half.)
# WORKERS=N: `kvferry up --router-workers N` (default 1; the rows say `router_workers`).
# ROUNDS=N: each target measured N times, interleaved (default 1; a noisy host drifts).
# MORE=kvferry@4: more targets after each stack's own (here: its router again, 4 workers).
# usage: KVFERRY_COMMIT=<commit> DUR=30 bash benchmarks/h200_router_dataplane.sh STACK...
set -uo pipefail
source benchmarks/lib.sh
gpu_env
if [ ! -d /tmp/site/vllm_router ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .kit/uvl/*.whl || exit 8
fi
export PYTHONPATH=$PYTHONPATH:/tmp/site
# kvferry is on PYTHONPATH, not installed: its console script, for the bench's own router
mkdir -p /tmp/kvpkg/bin && printf '#!/bin/sh\nexec python3 -m kvferry.scripts.cli "$@"\n' > /tmp/kvpkg/bin/kvferry
chmod +x /tmp/kvpkg/bin/kvferry && export PATH=/tmp/kvpkg/bin:$PATH
export KVFERRY_COMMIT=${KVFERRY_COMMIT:-unknown}
python3 -c "import aiohttp, uvloop, psutil, kvferry.router.api.app; print('imports ok', aiohttp.__version__)" || exit 7
M=/tmp/m06; model_dir qwen3-0.6b $M
DUR=${DUR:-30}
OUTF=$OUT/router_dataplane-$HW-$(date +%Y%m%d).jsonl
for S in "$@"; do
  case $S in
    nixl)   UPARGS="--connector vllm-nixl"; IMPLS=direct,kvferry,vllm-router ;;
    kvpull) UPARGS="--connector kvferry --mode pull"; IMPLS=direct,kvferry ;;
    kvpush) UPARGS="--connector kvferry --mode push"; IMPLS=direct,kvferry ;;
    overload) UPARGS="--connector kvferry --mode pull"; IMPLS=kvferry ;;
  esac
  t0=$(date +%s)
  python3 -m kvferry.scripts.cli up --hardware-backend cuda --share-device 30 --model $M $UPARGS \
    --router-workers ${WORKERS:-1} > $OUT/up-$S.log 2>&1 &
  UPPID=$!
  if ! wait_up; then echo "stack $S did not come up"; tail -30 $OUT/up-$S.log; stop_stack; continue; fi
  echo "stack $S up in $(( $(date +%s) - t0 )) s"
  if [ "$S" = overload ]; then  # a router of its own with 64 active + 64 queued, at 4x
    python3 benchmarks/router_dataplane.py --hardware $HW --no-pin --prefill http://127.0.0.1:8100 \
      --decode http://127.0.0.1:8200 --overload --max-active 64 --kvferry-arg=--max-queued \
      --kvferry-arg=64 --output-len 128 --duration $DUR --log-dir $OUT --out $OUTF 2>&1 | tail -15
  else
    python3 benchmarks/router_dataplane.py --hardware $HW --no-pin --prefill http://127.0.0.1:8100 \
      --decode http://127.0.0.1:8200 --kvferry http://127.0.0.1:8000 --duration $DUR \
      --impls $IMPLS${MORE:+,$MORE} \
      --rounds ${ROUNDS:-1} \
      --vllm-router /tmp/site/bin/vllm-router --log-dir $OUT --out $OUTF 2>&1 | tail -15
  fi
  # how the router's streamed chunks reached the clients (direct path or pump task)
  python3 -c "import urllib.request as u; print(''.join(l for l in u.urlopen('http://127.0.0.1:8000/metrics').read().decode().splitlines(True) if l.startswith('kvferry_router_stream_chunks_total')))" || true
  python3 - "$OUTF" "$S" <<'PY'
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1])]
for r in rows:
    r.setdefault("stack", sys.argv[2])
open(sys.argv[1],"w").write("".join(json.dumps(r)+"\n" for r in rows))
for r in rows:
    if r["stack"]==sys.argv[2]:
        print(r["stack"], r["impl"], r["concurrency"], r["tokens_per_s"], r["itl_ms_p99"], r["ttft_ms_p50"], r["ttft_ms_p99"], r["errors"], r.get("router_cpu_ms_per_1k_chunks"))
PY
  stop_stack
done
ls -la $OUT
