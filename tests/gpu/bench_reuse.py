"""Multi-turn reuse benchmark driver (one device call): turn-2 TTFT with D->P reuse on vs
off through kvferry's router, the local-hit ideal, and vLLM's built-in bidirectional
NixlConnector, same conversations; JSON lines (bench-schema) go to --out.

Per history size S: turn 1 = S tokens, turn 2 = turn 1 + D's answer + --new-tokens (512),
the agent pattern (a long history, a short new message). kvferry's P keeps prefix caching
on but the driver empties it (vLLM's dev endpoint /reset_prefix_cache) before every turn
of the on/off runs, so P has evicted the history (or is another P) and without reuse
recomputes it all; for local_hit it empties it only before turn 1 (the ideal: P still
holds the history). `d_local` (issue #17): a second router over the same engines with
its default turn policy, which sends a turn of at most 1024 new tokens straight to the D
holding the conversation's KV (D computes only the new tokens; no READ, no P); P's cache
is emptied as for on/off. One kvferry stack serves them all, so they share engines. D keeps
vLLM's default prefix caching: within a conversation it holds turn 1's blocks (under the
lease, or freed but still cached when reuse is off), so P pushes only the blocks D lacks;
between conversations the driver ends the lease and empties D's cache too.

vLLM's bidirectional connector is driven the way its proxy does: P leg, then D leg with
P's kv_transfer_params; D's final params (its leased blocks) go to P on turn 2. Its D runs
without prefix caching (its pinned blocks cannot be released early, so its cache could not
be emptied between the on and off runs, which share prompts).

    python tests/gpu/bench_reuse.py --shape qwen3-8b --history 2048,8192,16384,24576 \
        --out $OUT/bidirectional-h200x2-DATE.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers_http import serve  # noqa: E402
from stack import kvferry_router_settings, pd_stack  # noqa: E402

from kvferry.router.api.app import create_app  # noqa: E402
from kvferry.scripts.bench import git_commit  # noqa: E402
from kvferry.scripts.engines import shared_device_args  # noqa: E402
from kvferry.scripts.modelgen import SHAPES, write_model  # noqa: E402


def stream_turn(router: str, model: str, toks: list[int], out_len: int, cid: str | None,
                mode: str) -> tuple[float, list[int], int, float | None]:
    """(TTFT ms, output token ids, reused tokens, P leg ms) of one streamed turn."""
    body = {"model": model, "prompt": toks, "max_tokens": out_len, "min_tokens": out_len,
            "temperature": 0, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    if cid:
        body["conversation_id"] = cid
    t0 = time.perf_counter()
    timing: dict = {}
    reused, p_ms = 0, None
    with httpx.stream("POST", router + "/v1/completions", json=body, timeout=300,
                      headers={"x-kvferry-mode": mode}) as r:
        r.raise_for_status()
        reused = int(r.headers.get("x-kvferry-reused-tokens", "0"))
        for ev in sse_events(r, t0, timing):
            reused = int(ev.get("kvferry_reused_tokens", reused))
            p_ms = ev.get("kvferry_prefill_ms", p_ms)
    return timing["ttft"], timing["out"], reused, p_ms


def sse_events(r: httpx.Response, t0: float, timing: dict):
    """Yield a completion stream's events; fills timing["ttft"] (ms after t0, at the first
    token) and timing["out"] (the token ids)."""
    timing.setdefault("ttft", float("nan"))
    out = timing.setdefault("out", [])
    for line in r.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        for ch in ev.get("choices", []):
            if not out and (ch.get("text") or ch.get("token_ids")):
                timing["ttft"] = (time.perf_counter() - t0) * 1e3
            out += ch.get("token_ids") or []
        yield ev


def reset_prefix_cache(url: str) -> None:
    """Empty an engine's prefix cache (dev endpoint); retried while blocks are still held."""
    for _ in range(50):
        r = httpx.post(url + "/reset_prefix_cache", timeout=30)
        r.raise_for_status()
        if r.json().get("success", True):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{url}: prefix cache still busy")


def conversation(router: str, model: str, sizes: list[int], out_len: int, seed: int,
                 cid: str | None, mode: str, vocab: int, before_turn=None, turn_fn=None
                 ) -> list[dict]:
    rnd = random.Random(seed)
    toks: list[int] = []
    rows = []
    state: dict = {}
    for t, size in enumerate(sizes, 1):
        toks = toks + [rnd.randrange(100, vocab - 100) for _ in range(max(size - len(toks), 16))]
        if before_turn is not None:
            before_turn(t)
        if turn_fn is not None:  # vLLM's own bidirectional flow
            ttft, out, reused, p_ms = turn_fn(toks, out_len, state)
        else:
            ttft, out, reused, p_ms = stream_turn(router, model, toks, out_len, cid, mode)
        rows.append({"turn": t, "input_len": len(toks), "ttft_ms": ttft, "out": out,
                     "reused_tokens": reused, "prefill_ms": p_ms})
        toks = toks + (out or [rnd.randrange(100, vocab - 100) for _ in range(out_len)])
    return rows


def vllm_turn(p_url: str, d_url: str, model: str, reuse: bool):
    """One turn through vLLM's bidirectional NixlConnector, as its proxy drives it.

    Turn 1: P computes, D reads P's blocks (pull) and answers non-streaming so its final
    kv_transfer_params (the leased blocks) come back. Turn 2 (timed from the P leg's start
    to D's first streamed token): P gets those params and READs the history from D.
    """
    def turn(toks: list[int], out_len: int, state: dict
             ) -> tuple[float, list[int], int, float | None]:
        base = {"model": model, "prompt": toks, "temperature": 0, "return_token_ids": True}
        p_params = state.get("d_params") or {"do_remote_decode": True}
        t0 = time.perf_counter()
        p = httpx.post(p_url + "/v1/completions", timeout=300, json={
            **base, "max_tokens": 1, "kv_transfer_params": p_params})
        p.raise_for_status()
        kv = p.json().get("kv_transfer_params")
        p_ms = (time.perf_counter() - t0) * 1e3
        body = {**base, "max_tokens": out_len, "min_tokens": out_len, "kv_transfer_params": kv}
        reused = int(p_params.get("remote_num_tokens") or 0)  # offered by D (vLLM reports
        # no count of what P really read; TTFT shows it)
        if "d_params" not in state:  # turn 1: non-streaming, for D's params
            d = httpx.post(d_url + "/v1/completions", json=body, timeout=300)
            d.raise_for_status()
            j = d.json()
            state["d_params"] = j.get("kv_transfer_params") if reuse else None
            return (time.perf_counter() - t0) * 1e3, list(j["choices"][0]["token_ids"]), 0, p_ms
        timing: dict = {}
        with httpx.stream("POST", d_url + "/v1/completions", timeout=300,
                          json={**body, "stream": True}) as r:
            r.raise_for_status()
            for _ in sse_events(r, t0, timing):
                pass
        return timing["ttft"], timing["out"], reused, p_ms
    return turn


def run_mode(router: str, args, label: str, use_cid: bool, mode: str, seed0: int,
             before_turn=None, turn_factory=None) -> dict[int, list[list[dict]]]:
    """For each history size S: conversations of two turns, S tokens then S + answer +
    --new-tokens; returns {S: [turn rows per conversation]}."""
    out: dict[int, list[list[dict]]] = {}
    for si, size in enumerate(args.sizes):
        out[size] = []
        for c in range(args.conversations):
            cid = f"{label}-{size}-{c}-{os.getpid()}" if use_cid else None
            sizes = [size, size + args.output_len + args.new_tokens]
            rows = conversation(router, args.model_path, sizes, args.output_len,
                                seed0 + 100 * si + c, cid, mode, SHAPES[args.shape].vocab_size,
                                before_turn, turn_factory() if turn_factory else None)
            out[size].append(rows)
            if cid and router:  # end of conversation: D releases the lease at once
                httpx.delete(f"{router}/v1/kvferry/conversations/{cid}", timeout=30)
            print(label, size, c, [(r["input_len"], round(r["ttft_ms"], 1), r["reused_tokens"])
                                   for r in rows], flush=True)
    return out


def background_stream(router: str, model: str, toks: list[int], max_tokens: int,
                      stop: threading.Event, rec: dict) -> None:
    """One of D's other streams: decodes until `stop`, then the client hangs up (the router
    aborts it upstream); rec["times"] gets each chunk's arrival (perf_counter, tokens)."""
    body = {"model": model, "prompt": toks, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "temperature": 0, "stream": True, "return_token_ids": True}
    times = rec.setdefault("times", [])
    with httpx.stream("POST", router + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ev = json.loads(line[6:])
                n = sum(len(ch.get("token_ids") or []) for ch in ev.get("choices", []))
                if n:
                    times.append((time.perf_counter(), n))
            if stop.is_set():
                return


def wait_idle(url: str, timeout_s: float = 60) -> None:
    """Until vLLM's gauge of running + waiting requests reads 0."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        busy = sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                   if ln.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))
        if busy == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: {busy} requests still open")
        time.sleep(0.2)


def window_tpot(times: list[tuple[float, int]], lo: float, hi: float) -> float | None:
    """A stream's time per output token over the chunks that arrived in [lo, hi]."""
    w = [(t, n) for t, n in times if lo <= t <= hi]
    if len(w) < 2:
        return None
    return (w[-1][0] - w[0][0]) * 1e3 / sum(n for _, n in w[1:])


def load_run(turn_router: str, bg_router: str, args, label: str, seed0: int,
             turns: bool, streams: int | None = None) -> dict:
    """TPOT of --load-streams streams decoding on D while turn 2s of --load-history
    conversations arrive at --turn-rate per second through `turn_router` (none if not
    `turns`); each conversation's turn 1 is served beforehand (it leaves D a lease)."""
    vocab, model = SHAPES[args.shape].vocab_size, args.model_path
    n_turns = int(args.turn_rate * args.load_window_s)
    rnd = random.Random(seed0)
    convs = []
    for c in range(n_turns if turns else 0):
        cid = f"{label}-{c}-{os.getpid()}"
        toks = [rnd.randrange(100, vocab - 100) for _ in range(args.load_history)]
        _, out, _, _ = stream_turn(turn_router, model, toks, args.output_len, cid, args.mode)
        extra = [rnd.randrange(100, vocab - 100) for _ in range(args.new_tokens)]
        convs.append((cid, toks + out + extra))
    stop, recs = threading.Event(), [dict() for _ in range(streams or args.load_streams)]
    bg = [threading.Thread(target=background_stream, daemon=True, args=(
        bg_router, model, [rnd.randrange(100, vocab - 100) for _ in range(args.load_context)],
        args.load_bg_tokens, stop, rec)) for rec in recs]
    for t in bg:
        t.start()
    deadline = time.monotonic() + 300
    while not all(rec.get("times") for rec in recs):  # every stream decoding on D
        if time.monotonic() > deadline or any(not t.is_alive() and not r.get("times")
                                              for t, r in zip(bg, recs, strict=True)):
            raise RuntimeError(f"{label}: background streams did not all start")
        time.sleep(0.05)
    time.sleep(0.5)
    lo = time.perf_counter()
    ttfts, routes, threads = [], [], []

    def one(cid: str, toks: list[int]) -> None:
        body = {"model": model, "prompt": toks, "max_tokens": args.output_len,
                "min_tokens": args.output_len, "temperature": 0, "stream": True,
                "return_token_ids": True, "conversation_id": cid}
        t0, timing = time.perf_counter(), {}
        with httpx.stream("POST", turn_router + "/v1/completions", json=body, timeout=300,
                          headers={"x-kvferry-mode": args.mode}) as r:
            r.raise_for_status()
            routes.append(r.headers.get("x-kvferry-route", "p"))
            for _ in sse_events(r, t0, timing):
                pass
        ttfts.append(timing["ttft"])

    for i, (cid, toks) in enumerate(convs):
        time.sleep(max(0.0, lo + i / args.turn_rate - time.perf_counter()))
        threads.append(threading.Thread(target=one, args=(cid, toks)))
        threads[-1].start()
    time.sleep(max(0.0, lo + args.load_window_s - time.perf_counter()))
    for t in threads:
        t.join()
    hi = time.perf_counter()
    stop.set()
    for t in bg:
        t.join(timeout=60)
    for cid, _ in convs:
        httpx.delete(f"{turn_router}/v1/kvferry/conversations/{cid}", timeout=30)
    wait_idle(args.d_url)  # the hung-up streams aborted on D before the next run
    tpots = sorted(x for x in (window_tpot(r["times"], lo, hi) for r in recs) if x is not None)
    gaps = sorted((t1 - t0) * 1e3 for r in recs for (t0, _), (t1, _) in
                  zip(r["times"], r["times"][1:], strict=False) if lo <= t0 and t1 <= hi)
    row = {"label": label, "window_s": round(hi - lo, 2), "turns": len(ttfts), "streams": len(recs),
           "tpot": tpots, "gaps": gaps, "ttfts": sorted(ttfts),
           "routes": {k: routes.count(k) for k in set(routes)}}
    print(label, {k: v for k, v in row.items() if k not in ("gaps", "tpot", "ttfts")},
          "tpot p50/p90", _pct(tpots, 0.5), _pct(tpots, 0.9), "gap p99", _pct(gaps, 0.99),
          "turn ttft p50", _pct(sorted(ttfts), 0.5), flush=True)
    return row


def _pct(xs: list[float], q: float) -> float | None:
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def check_load_fits(args) -> None:
    """Refuse a load run whose KV does not fit D: background streams at full length plus
    the turns' leased histories and their new tokens. (Measured, commit 4042ad1, one H200,
    40 GiB: 16 streams decoding without bound plus 8 leased 24k histories ran D out of
    blocks; the turns then waited 25-34 s for memory, whatever the policy.)"""
    sh = SHAPES[args.shape]
    block_bytes = 16 * sh.num_hidden_layers * sh.num_key_value_heads * sh.head_dim * 2 * 2
    blocks = int(args.kv_gib * (1 << 30)) // block_bytes
    bg = args.load_streams * -(-(args.load_context + args.load_bg_tokens) // 16)
    turns = int(args.turn_rate * args.load_window_s)
    hist = -(-(args.load_history + args.output_len + args.new_tokens + args.output_len) // 16)
    need = bg + turns * hist
    print(f"load run KV: {bg} background + {turns} x {hist} turn blocks = {need} of {blocks}",
          flush=True)
    if need > 0.95 * blocks:
        raise SystemExit(f"the load run needs {need} KV blocks, D has {blocks}: raise --kv-gib "
                         "or lower --turn-rate x --load-window-s / --load-streams")


def _command() -> str:
    return "python tests/gpu/bench_reuse.py " + " ".join(sys.argv[1:])


def write_turn_rows(args, results) -> None:
    """One line per (impl, mode, history, turn); outputs compared with reuse_off's."""
    cmd = _command()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        for (impl, mode), by_size in results.items():
            for size, convs in by_size.items():
                for ti in range(2):
                    rows = [conv[ti] for conv in convs]
                    offs = [conv[ti] for conv in results[impl, "reuse_off"][size]]
                    ttfts = sorted(r["ttft_ms"] for r in rows)
                    f.write(json.dumps({
                        "experiment": "bidirectional", "impl": impl, "mode": mode,
                        "transfer_mode": args.mode if impl == "kvferry" else "pull",
                        "hardware": args.hardware,
                        "model": args.shape, "turn": ti + 1, "history_len": size,
                        "input_len": rows[0]["input_len"], "new_tokens": args.new_tokens,
                        "output_len": args.output_len, "qps": 0, "n": len(rows),
                        "ttft_ms_p50": round(statistics.median(ttfts), 3),
                        "ttft_ms_p90": round(ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))], 3),
                        "reused_tokens": int(statistics.median(r["reused_tokens"] for r in rows)),
                        "prefill_ms_p50": _median([r["prefill_ms"] for r in rows]),
                        "outputs_match": all(r["out"] == o["out"]
                                             for r, o in zip(rows, offs, strict=True)),
                        "command": cmd, "commit": git_commit()[0],
                        "date": date.today().isoformat()}) + "\n")


def write_load_rows(args, base: dict, loads: list[tuple[str, dict]]) -> None:
    """One line per load run: D's other streams' TPOT while turns arrive, against the run
    without turns (background_tpot_p90_ratio), and the turns' TTFT and routes."""
    b90 = _pct(base["tpot"], 0.9)
    with open(args.out, "a") as f:
        for mode, row in [("no_turns", base)] + loads:
            p90 = _pct(row["tpot"], 0.9)
            f.write(json.dumps({
                "experiment": "bidirectional_load", "impl": "kvferry", "mode": mode,
                "transfer_mode": args.mode, "hardware": args.hardware, "model": args.shape,
                "history_len": args.load_history, "new_tokens": args.new_tokens,
                "output_len": args.output_len, "qps": args.turn_rate if row["turns"] else 0,
                "n": row["turns"], "background_streams": row["streams"],
                "background_context": args.load_context, "window_s": row["window_s"],
                "ttft_ms_p50": _pct(row["ttfts"], 0.5), "ttft_ms_p90": _pct(row["ttfts"], 0.9),
                "background_tpot_ms_p50": _pct(row["tpot"], 0.5),
                "background_tpot_ms_p90": p90,
                "background_itl_ms_p99": _pct(row["gaps"], 0.99),
                "background_tpot_p90_ratio": round(p90 / b90, 3) if p90 and b90 else None,
                "routes": row["routes"], "command": _command(), "commit": git_commit()[0],
                "date": date.today().isoformat()}) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--history", default="2048,8192,16384,24576",
                    help="turn-1 prompt sizes; turn 2 adds the answer and --new-tokens")
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--mode", default="push", choices=("push", "pull"))
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--hardware", default="h200x2")
    ap.add_argument("--out", required=True)
    ap.add_argument("--eager", action="store_true", help="engines without CUDA graphs")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-reuse-on", action="store_true",
                    help="no D -> P reuse runs (one GPU: P's READ from D stalls for seconds)")
    ap.add_argument("--one-gpu", action="store_true",
                    help="P and D share GPU 0 (a fixed KV size each): when one GPU is lent")
    ap.add_argument("--load-streams", type=int, default=16,
                    help="D's other streams during the load runs (0: no load runs)")
    ap.add_argument("--load-context", type=int, default=8192)
    ap.add_argument("--load-history", type=int, default=24576)
    ap.add_argument("--turn-rate", type=float, default=2.0, help="turn 2s per second")
    ap.add_argument("--load-window-s", type=float, default=2.5)
    ap.add_argument("--load-only", action="store_true", help="after the warm-up, only the load runs")
    ap.add_argument("--pressure-streams", type=int, default=0,
                    help="one more D-local load run with this many streams: more KV than D "
                         "holds with the turns' leases, which must yield")
    ap.add_argument("--kv-gib", type=float, default=30, help="--one-gpu: KV cache per engine")
    ap.add_argument("--load-bg-tokens", type=int, default=1500,
                    help="output tokens of each background stream (bounds its KV: it must "
                         "outlast the streams' staggered start and the window)")
    args = ap.parse_args()
    args.sizes = [int(x) for x in args.history.split(",")]
    tmp = Path(tempfile.mkdtemp())
    args.model_path = str(write_model(tmp / args.shape, args.shape))
    args.max_model_len = max(args.sizes + [args.load_history]) + 2048
    common: tuple[str, ...] = ("--max-model-len", str(args.max_model_len))
    if args.backend == "cpu":  # a local smoke run of this driver
        args.hardware = "cpu"
    if args.backend == "cuda" and args.one_gpu:  # two engines profiling at once confuse
        common += shared_device_args(args.kv_gib)  # as `kvferry up --share-device GIB`
        args.hardware = "h200x1"
    elif args.backend == "cuda":
        common += ("--gpu-memory-utilization", "0.85")
    if args.eager:
        common += ("--enforce-eager",)
    if args.load_streams and args.backend == "cuda" and args.one_gpu:
        check_load_fits(args)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
    results: dict[tuple[str, str], dict[int, list[list[dict]]]] = {}
    t0 = time.monotonic()
    # reuse_on rows measure P + D -> P reuse: the router's D-local route is kept out.
    devices = ((0,), (0,)) if args.one_gpu else (None, None)
    with pd_stack(args.model_path, tmp / "logs", backend=args.backend, engine_args=common,
                  router={"d_local_max_new_tokens": 0}, devices=devices) as s:
        print(f"stack up in {time.monotonic() - t0:.0f}s", flush=True)
        p_url, d_url = s.prefill.url, s.decode.url
        args.d_url = d_url

        def evicted(turn: int) -> None:  # P lost the history (or is another P)
            reset_prefix_cache(p_url)
            if turn == 1:  # a new conversation: nobody has seen its prompt
                reset_prefix_cache(d_url)

        def warm_only(turn: int) -> None:  # P keeps what turn 1 computed
            if turn == 1:
                reset_prefix_cache(p_url)
                reset_prefix_cache(d_url)

        run_mode(s.router, args, "warmup", True, args.mode, 90_000, evicted)  # other prompts
        if args.load_only:
            args.skip_reuse_on = True
        if not args.skip_reuse_on:
            results["kvferry", "reuse_on"] = run_mode(s.router, args, "reuse_on", True,
                                                      args.mode, 1000, evicted)
        if not args.load_only:
            results["kvferry", "reuse_off"] = run_mode(s.router, args, "reuse_off", False,
                                                       args.mode, 1000, evicted)
            results["kvferry", "local_hit"] = run_mode(s.router, args, "local_hit", False,
                                                       args.mode, 1000, warm_only)
        d_local = kvferry_router_settings([s.prefill], [s.decode], prefill_timeout_s=300,
                                          decode_timeout_s=300)  # the default turn policy
        with serve(create_app(d_local, s.secret.encode())) as local_router:
            if not args.load_only:
                results["kvferry", "d_local"] = run_mode(local_router, args, "d_local", True,
                                                         args.mode, 1000, evicted)
                # the ceiling: D alone serving both turns, turn 2 from its own prefix cache
                results["kvferry", "engine_local_hit"] = run_mode(
                    d_url, args, "engine_local_hit", False, args.mode, 1000, warm_only)
                lines = [ln for ln in s.prefill.log().splitlines() if "reuse READ" in ln]
                print("prefill", len(lines), "reuse READs; last:", lines[-2:], flush=True)
                write_turn_rows(args, results)
            if args.load_streams:
                reset_prefix_cache(p_url)
                reset_prefix_cache(d_url)
                base = load_run(local_router, local_router, args, "no_turns", 5000, False)
                loads = [(mode, load_run(router, router, args, mode, 6000 + 1000 * i, True))
                         for i, (mode, router) in enumerate((("d_local", local_router),
                                                             ("reuse_on", s.router)))]
                if args.pressure_streams:
                    loads.append(("d_local_pressure", load_run(
                        local_router, local_router, args, "d_local_pressure", 9000, True,
                        args.pressure_streams)))
                early = [ln for ln in s.decode.log().splitlines() if "released early" in ln]
                print("decode released", len(early), "lease batches early; last:", early[-2:],
                      flush=True)
                write_load_rows(args, base, loads)
        results.clear()
    if not args.skip_vllm:
        t0 = time.monotonic()
        no_pc = ("--no-enable-prefix-caching",)
        with pd_stack(args.model_path, tmp / "logs-vllm", connector="vllm-nixl",
                      backend=args.backend, engine_args=common + no_pc,
                      extra={"bidirectional_kv_xfer": True}) as s:
            print(f"vLLM bidirectional stack up in {time.monotonic() - t0:.0f}s", flush=True)
            p_url, d_url = s.prefill.url, s.decode.url

            def factory(reuse: bool):
                return lambda: vllm_turn(p_url, d_url, args.model_path, reuse)

            run_mode("", args, "vllm-warmup", False, args.mode, 90_000, None, factory(True))
            results["vllm-0.26.0", "reuse_on"] = run_mode("", args, "vllm-on", False, "pull",
                                                          1000, None, factory(True))
            results["vllm-0.26.0", "reuse_off"] = run_mode("", args, "vllm-off", False, "pull",
                                                           1000, None, factory(False))

    write_turn_rows(args, results)
    print(Path(args.out).read_text(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
