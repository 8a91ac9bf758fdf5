# Shared by the benchmark drivers (sourced, not run): the GPU machine's environment and a
# `kvferry up` stack's life cycle on the default ports (router 8000, P 8100, D 8200).

# The GPU kit (.kit, shared gpukit README) installed and in the environment, and this
# checkout importable as `kvferry` (it is on PYTHONPATH there, not installed).
gpu_env() {
  bash .kit/install.sh .kit >/dev/null || exit 9
  source /tmp/kit-site/kit-env.sh
  mkdir -p /tmp/kvpkg/kvferry
  for t in connectors router neuron scripts; do ln -sfn "$PWD/$t" /tmp/kvpkg/kvferry/$t; done
  export PYTHONPATH=/tmp/kvpkg:$PYTHONPATH PYTHONUNBUFFERED=1
  # the card the device lent (H100 or H200), for the rows' hardware field and file names
  HW=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H200 && echo h200x1 || echo h100x1)
}

# A model directory of a shape (dummy weights) at DIR, made once.
model_dir() {  # SHAPE DIR
  [ -d "$2" ] || python3 -m kvferry.scripts.cli model --shape "$1" "$2" >/dev/null || exit 6
}

# Wait until the router, P and D all answer /health (the router answers first).
wait_up() {
  for _ in $(seq 1 "${1:-300}"); do
    curl -sf localhost:8100/health >/dev/null && curl -sf localhost:8200/health >/dev/null \
      && curl -sf localhost:8000/health >/dev/null && return 0
    sleep 1
  done
  return 1
}

# Stop the stack started as $UPPID (SIGINT: `kvferry up` stops its engines), then free the ports.
stop_stack() {
  kill -INT "$UPPID" 2>/dev/null
  for _ in $(seq 1 40); do kill -0 "$UPPID" 2>/dev/null || break; sleep 1; done
  kill -9 "$UPPID" 2>/dev/null
  for p in 8000 8100 8200; do fuser -k $p/tcp 2>/dev/null; done
  sleep 3
}
