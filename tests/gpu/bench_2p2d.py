"""H200 x4 driver (issue #6): two prefill + two decode engines, one GPU each, behind one
router; kvferry push and pull at rising QPS, then P0 alone (colocated) for reference.
Lines go to --out's folder (bench-schema).

    python tests/gpu/bench_2p2d.py --shape qwen3-0.6b --input-len 16384 --qps 4,8,16,24 \
        --out $OUT/2p2d-h200x4-DATE.jsonl
"""

from __future__ import annotations

import secrets
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_pd import ENGINE_ARGS, bench, serving_args  # noqa: E402
from helpers_http import serve  # noqa: E402
from stack import STARTUP_S, kvferry_router_settings, start_engine  # noqa: E402

from kvferry.router.api.app import create_app  # noqa: E402
from kvferry.scripts.modelgen import write_model  # noqa: E402
from kvferry.scripts.procs import stop_all, wait_healthy  # noqa: E402


def main() -> int:
    args = serving_args("16384", "4,8,16,24", 24, 300).parse_args()
    tmp = Path(tempfile.mkdtemp())
    model = str(write_model(tmp / args.shape, args.shape))
    secret = secrets.token_hex(16)
    t0 = time.monotonic()
    with ExitStack() as stack:
        children: list = []
        stack.callback(stop_all, children)
        engines = {}
        for name, role, gpu in (("p0", "prefill", 0), ("p1", "prefill", 1),
                                ("d0", "decode", 2), ("d1", "decode", 3)):
            e = engines[name] = start_engine(role, model, tmp / "logs", secret, backend="cuda",
                                             engine_args=ENGINE_ARGS, devices=(gpu,))
            children.append(e.child)
        wait_healthy(children, STARTUP_S)
        ps, ds = [engines["p0"], engines["p1"]], [engines["d0"], engines["d1"]]
        settings = kvferry_router_settings(ps, ds, prefill_timeout_s=120, decode_timeout_s=120)
        router = stack.enter_context(serve(create_app(settings, secret.encode())))
        print(f"2P2D up in {time.monotonic() - t0:.0f}s", flush=True)
        args.hardware = "h200x4"
        bench([f"kvferry-2p2d-push={router},impl=kvferry,mode=push,x-kvferry-mode=push",
               f"kvferry-2p2d-pull={router},impl=kvferry,mode=pull,x-kvferry-mode=pull",
               f"colocated-1gpu={ps[0].url},impl=colocated,mode=colocated"], args, "2p2d")
        for e in ps + ds:
            log = e.log()
            print(e.role, e.url, "WRITEs", log.count("kvferry WRITE"), "READs",
                  log.count("kvferry READ"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
