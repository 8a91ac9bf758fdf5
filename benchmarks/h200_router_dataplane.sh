#!/usr/bin/env bash
# The H200 run of benchmarks/router_dataplane.py: one GPU (the device machine), GPU kit in
# .kit (shared gpukit README), vllm-router (+ orjson, setproctitle) and uvloop wheels in .whl
# and .kit/uvl; for each
# STACK (nixl: vLLM NixlConnector engines, all three impls; kvpull / kvpush: kvferry's
# connector) `kvferry up --share-device 30` on a qwen3-0.6b shape, then the bench.
# (overload: kvferry's router alone at 4x its admission capacity of 64 + 64, then at half.)
# usage: KVFERRY_COMMIT=<commit> DUR=30 [HW=h100x1] bash benchmarks/h200_router_dataplane.sh STACK...
# (HW: the card the device tool gave, for the rows and the file name; default h200x1)
set -uo pipefail
bash .kit/install.sh .kit >/dev/null || exit 9
source /tmp/kit-site/kit-env.sh
if [ ! -d /tmp/site/vllm_router ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .kit/uvl/*.whl || exit 8
fi
mkdir -p /tmp/kvpkg/kvferry
for t in connectors router neuron scripts; do ln -sfn "$PWD/$t" /tmp/kvpkg/kvferry/$t; done
export PYTHONPATH=/tmp/kvpkg:$PYTHONPATH:/tmp/site
# kvferry is on PYTHONPATH, not installed: its console script, for the bench's own router
mkdir -p /tmp/kvpkg/bin && printf '#!/bin/sh\nexec python3 -m kvferry.scripts.cli "$@"\n' > /tmp/kvpkg/bin/kvferry
chmod +x /tmp/kvpkg/bin/kvferry && export PATH=/tmp/kvpkg/bin:$PATH
export KVFERRY_COMMIT=${KVFERRY_COMMIT:-unknown} PYTHONUNBUFFERED=1
python3 -c "import aiohttp, uvloop, psutil, kvferry.router.api.app; print('imports ok', aiohttp.__version__)" || exit 7
M=/tmp/m06; [ -d $M ] || python3 -m kvferry.scripts.cli model --shape qwen3-0.6b $M >/dev/null || exit 6
DUR=${DUR:-30} HW=${HW:-h200x1}
OUTF=$OUT/router_dataplane-$HW-$(date +%Y%m%d).jsonl
wait_up() { for i in $(seq 1 300); do
  curl -sf localhost:8100/health >/dev/null && curl -sf localhost:8200/health >/dev/null && curl -sf localhost:8000/health >/dev/null && return 0; sleep 1; done; return 1; }
stop() { kill -INT $UPPID 2>/dev/null; for i in $(seq 1 40); do kill -0 $UPPID 2>/dev/null || break; sleep 1; done; kill -9 $UPPID 2>/dev/null
  for p in 8000 8100 8200; do fuser -k $p/tcp 2>/dev/null; done; sleep 3; }
for S in "$@"; do
  case $S in
    nixl)   UPARGS="--connector vllm-nixl"; IMPLS=direct,kvferry,vllm-router ;;
    kvpull) UPARGS="--connector kvferry --mode pull"; IMPLS=direct,kvferry ;;
    kvpush) UPARGS="--connector kvferry --mode push"; IMPLS=direct,kvferry ;;
    overload) UPARGS="--connector kvferry --mode pull"; IMPLS=kvferry ;;
  esac
  t0=$(date +%s)
  python3 -m kvferry.scripts.cli up --hardware-backend cuda --share-device 30 --model $M $UPARGS > $OUT/up-$S.log 2>&1 &
  UPPID=$!
  if ! wait_up; then echo "stack $S did not come up"; tail -30 $OUT/up-$S.log; stop; continue; fi
  echo "stack $S up in $(( $(date +%s) - t0 )) s"
  if [ "$S" = overload ]; then  # a router of its own with 64 active + 64 queued, at 4x
    python3 benchmarks/router_dataplane.py --hardware $HW --no-pin --prefill http://127.0.0.1:8100 \
      --decode http://127.0.0.1:8200 --overload --max-active 64 --kvferry-arg=--max-queued \
      --kvferry-arg=64 --output-len 128 --duration $DUR --log-dir $OUT --out $OUTF 2>&1 | tail -15
  else
    python3 benchmarks/router_dataplane.py --hardware $HW --no-pin --prefill http://127.0.0.1:8100 \
      --decode http://127.0.0.1:8200 --kvferry http://127.0.0.1:8000 --duration $DUR --impls $IMPLS \
      --vllm-router /tmp/site/bin/vllm-router --log-dir $OUT --out $OUTF 2>&1 | tail -15
  fi
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
  stop
done
ls -la $OUT
