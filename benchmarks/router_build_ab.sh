#!/usr/bin/env bash
# A/B of the router's CPU between two builds (issue 33): BASE's router and this checkout's,
# both pinned to core 0, against the same fake engines (benchmarks/fake_engine.py, core 1),
# `benchmarks/router_dataplane.py --kvferry URL --impls kvferry` per build, alternating
# builds for ROUNDS rounds so a drifting host hits both alike. Prints one line per build and
# round (tokens/s, inter-token p99 ms, TTFT p50 ms, errors, router CPU ms per 1k chunks);
# rows go to $OUT (default /tmp/router_build_ab.jsonl, not benchmarks/results: the bench
# records this checkout's commit for both builds).
# usage: bash benchmarks/router_build_ab.sh BASE [ROUNDS] [STREAMS] [SECONDS] [OUTPUT_LEN]
set -uo pipefail
cd "$(dirname "$0")/.."
BASE=${1:?base commit}; ROUNDS=${2:-2}; STREAMS=${3:-256}; DUR=${4:-15}; OLEN=${5:-256}
OUT=${OUT:-/tmp/router_build_ab.jsonl}
PY=.venv/bin/python
WT=$(mktemp -d /tmp/kvferry-ab-XXXX); PKG=$WT/pkg
git worktree add -q "$WT/tree" "$BASE" || exit 2
mkdir -p "$PKG/kvferry"
# the base build as the package `kvferry` (PYTHONPATH goes before the editable install)
for t in connectors router neuron scripts; do ln -sfn "$WT/tree/$t" "$PKG/kvferry/$t"; done
read -r P D RB RN < <($PY -c "import socket
socks = [socket.socket() for _ in range(4)]
for s in socks: s.bind(('127.0.0.1', 0))
print(*(s.getsockname()[1] for s in socks))")
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null; git worktree remove --force "$WT/tree"; rm -rf "$WT"; }
trap cleanup EXIT
for port in $P $D; do
  taskset -c 1 $PY benchmarks/fake_engine.py "$port" >/dev/null 2>&1 & pids+=($!)
done
router() {  # PORT [PYTHONPATH]
  PYTHONPATH=${2:-} taskset -c 0 $PY -m kvferry.scripts.cli router --prefill "http://127.0.0.1:$P" \
    --decode "http://127.0.0.1:$D" --port "$1" --health-interval 0 >/dev/null 2>&1 & pids+=($!)
}
router $RB "$PKG"; router $RN
for port in $P $D $RB $RN; do
  for _ in $(seq 120); do curl -sf "localhost:$port/health" >/dev/null && break; sleep 0.5; done
done
for round in $(seq "$ROUNDS"); do
  for build in base this; do
    port=$RB; [ $build = this ] && port=$RN
    $PY benchmarks/router_dataplane.py --prefill "http://127.0.0.1:$P" --decode "http://127.0.0.1:$D" \
      --kvferry "http://127.0.0.1:$port" --impls kvferry --concurrency "$STREAMS" \
      --duration "$DUR" --output-len "$OLEN" --out "$OUT" >/dev/null 2>&1 || { echo "bench failed"; exit 3; }
    tail -1 "$OUT" | $PY -c "import sys, json; d = json.loads(sys.stdin.read()); print('$build', '$round', \
d['tokens_per_s'], d['itl_ms_p99'], d['ttft_ms_p50'], d['errors'], d['router_cpu_ms_per_1k_chunks'])"
  done
done
