"""H200 x2 push-vs-pull benchmark driver: kvferry push, kvferry pull, the prefill engine
serving alone (colocated), with --layerwise kvferry push written layer by layer (a second
stack), then vLLM's built-in NixlConnector (pull) and NixlPushConnector (push), the latter
driven by the same router; same model shape, prompt lengths and rates; lines go to --out.
Engines run with CUDA graphs unless --eager.

    python tests/gpu/bench_pd.py --shape qwen3-0.6b --input-len 4096,16384 --qps 2,8 \
        --out $OUT/push_vs_pull-h200x2-DATE.jsonl
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("KVFERRY_TIMELINE", "1")  # engines inherit it; read at import below
# The router shows which engines served a request (x-kvferry-transfer-id: the timeline's
# key) only to its operator; the bench client sends the same token (bench_core).
os.environ.setdefault("KVFERRY_OPERATOR_TOKEN", "bench-" + os.urandom(8).hex())

from stack import pd_stack  # noqa: E402

from kvferry.connectors.detokenizer_window import METRIC as WINDOW_METRIC  # noqa: E402
from kvferry.connectors.protocol import timeline  # noqa: E402
from kvferry.scripts.bench import git_commit  # noqa: E402
from kvferry.scripts.engines import shared_device_args  # noqa: E402
from kvferry.scripts.modelgen import SHAPES, write_model  # noqa: E402


class _Lines(logging.Handler):
    """The in-process router's timeline marks."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


ROUTER_MARKS = _Lines()
logging.getLogger("kvferry.router.flow").addHandler(ROUTER_MARKS)
logging.getLogger("kvferry.router.flow").setLevel(logging.INFO)


def bench(targets: list[str], args, experiment: str, raw: Path | None = None) -> None:
    cmd = [sys.executable, "-m", "kvferry.scripts.cli", "bench", "--experiment", experiment,
           "--hardware", args.hardware, "--model-name", args.shape,
           "--vocab", str(SHAPES[args.shape].vocab_size),
           "--input-len", args.input_len, "--output-len", str(args.output_len), "--qps", args.qps,
           "--num-requests", str(args.num_requests), "--results-dir", str(Path(args.out).parent)]
    for t in targets:
        cmd += ["--target", t]
    if raw is not None:
        cmd += ["--raw", str(raw)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=False, timeout=args.budget_s)


# Layer-wise push (issue #20): per-layer KV planes on both engines, so each layer's blocks
# are runs of whole descriptors (cross-layer blocks hold every layer in one block).
LAYERWISE = {"layerwise_push": True, "cross_layer_blocks": False}


def run_kvferry(args, model: str, tmp: Path, engine_args: tuple[str, ...],
                layerwise: bool = False) -> None:
    """One kvferry stack: push, pull and colocated; with ``layerwise`` a stack whose P
    writes layer by layer, push only (``kvferry-push-layerwise``)."""
    t0 = time.monotonic()
    name = "layerwise" if layerwise else "whole"
    raw = tmp / f"raw-{name}.jsonl"
    engine_means: list[dict] = []
    devices = ((0,), (0,)) if args.one_gpu else (None, None)
    with pd_stack(model, tmp / f"logs-{name}", backend=args.backend, engine_args=engine_args,
                  devices=devices, extra=LAYERWISE if layerwise else None) as s:
        print(f"kvferry stack ({name}) up in {time.monotonic() - t0:.0f}s", flush=True)
        # 0: vLLM's detokenizer primes with the whole prompt (connectors/detokenizer_window.py)
        window = {e.role: e.metric(WINDOW_METRIC) for e in (s.prefill, s.decode)}
        print("detokenizer window:", window, flush=True)
        bs = f"-bs{args.block_size}" if args.block_size else ""
        targets = ([f"kvferry-push-layerwise{bs}={s.router},impl=kvferry,mode=push_layerwise,"
                    "x-kvferry-mode=push"] if layerwise else
                   [f"kvferry-push{bs}={s.router},impl=kvferry,mode=push,x-kvferry-mode=push",
                    # the same push with D's own first token (router/legs/first_token.py)
                    f"kvferry-push-d-token{bs}={s.router},impl=kvferry,mode=push,"
                    "x-kvferry-mode=push,x-kvferry-first-token=decode",
                    f"kvferry-pull{bs}={s.router},impl=kvferry,mode=pull,x-kvferry-mode=pull",
                    f"colocated{bs}={s.prefill.url},impl=colocated,mode=colocated"])
        for qps in args.qps.split(","):
            for target in targets:
                before = {e.role: scrape(e.url) for e in (s.prefill, s.decode)}
                bench([target], argparse.Namespace(**{**vars(args), "qps": qps}),
                      "push_vs_pull", raw)
                engine_means.append({"target": target.split("=", 1)[0], "qps": float(qps), **{
                    f"{e.role}_{k}": v for e in (s.prefill, s.decode)
                    for k, v in means(before[e.role], scrape(e.url)).items()}})
                print("engine means:", engine_means[-1], flush=True)
        for e in (s.prefill, s.decode):
            lines = [ln for ln in e.log().splitlines() if "kvferry WRITE" in ln or "kvferry READ" in ln]
            print(e.role, len(lines), "transfers; last:", lines[-2:], flush=True)
        outputs = check_outputs(s, args, targets)
        st = s.prefill.stats()
        print("P counters:", {k: st[k] for k in ("writes_done", "writes_failed", "layered_writes",
                                                 "layers_posted_early", "layer_batches")},
              flush=True)
        meta = {"experiment": "push_timeline", "impl": "kvferry", "hardware": args.hardware,
                "model": args.shape, "command": shlex.join([sys.executable, *sys.argv]),
                "commit": git_commit()[0], "date": time.strftime("%Y-%m-%d"),
                "detokenize_window": window}
        writes = p_writes(s.prefill.log())
        report = push_timeline(raw, [s.prefill.log(), s.decode.log(), *ROUTER_MARKS.lines],
                               meta, writes)
        report += write_costs(raw, writes)
        report.append({"experiment": "outputs_identical", **outputs,
                       "router_counters": router_counters(s.router)})
    out = Path(args.out).with_suffix(".timeline.jsonl")
    with out.open("a") as f:
        for line in report + engine_means:
            print("push timeline:", line, flush=True)
            f.write(json.dumps({**meta, **line}) + "\n")


def _stream(url: str, body: dict, headers: dict[str, str]) -> tuple[list[int], str]:
    """One streamed completion through the bench's own parser: token ids and text."""
    from kvferry.scripts.bench_core import Result, StreamState

    st = StreamState(Result(target=url, index=0, prompt_len=len(body["prompt"])))
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers,
                      timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            st.feed(line, 0.0)
    if st.res.error:
        raise RuntimeError(f"{url}: {st.res.error}")
    return st.ids, st.text


def _first_diff(got: list[int], want: list[int]) -> int | None:
    """Index of the first token that differs (or where one stream ended); None if equal."""
    if got == want:
        return None
    return next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                min(len(got), len(want)))


def check_outputs(s, args, targets: list[str], n: int = 4) -> dict:
    """Greedy outputs through each target vs P serving the same prompt alone, one request
    at a time (issue #20: outputs identical). Token ids and text of ``n`` prompts of the
    run's longest input length; the router's counters say which ones P's token 1 served."""
    from kvferry.scripts.bench_core import make_prompt, parse_target, request_body

    model = httpx.get(s.prefill.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    length = max(int(x) for x in args.input_len.split(","))
    paths = {t.name: (t.url, dict(t.headers)) for t in
             (parse_target(spec, "kvferry", "push") for spec in targets) if t.impl != "colocated"}
    paths["colocated"] = (s.prefill.url, {})
    out: dict = {"prompts": n, "input_len": length, "output_len": args.output_len}
    got: dict[str, list[tuple[list[int], str]]] = {k: [] for k in paths}
    for i in range(n):
        body = request_body(make_prompt(f"outputs:{i}", length, SHAPES[args.shape].vocab_size),
                            args.output_len, model, token_ids=True)
        for name, (url, headers) in paths.items():
            got[name].append(_stream(url, body, headers))
    want = got.pop("colocated")
    for name, outs in got.items():
        pairs = list(zip(outs, want, strict=True))
        diffs = [_first_diff(g[0], w[0]) for g, w in pairs]
        out[name] = {"identical_ids": sum(d is None and len(g[0]) > 0
                                          for d, (g, _) in zip(diffs, pairs, strict=True)),
                     "identical_text": sum(g[1] == w[1] for g, w in pairs),
                     "first_diff_at": diffs, "tokens": [len(g[0]) for g in outs]}
    print("outputs vs colocated:", out, flush=True)
    return out


ROUTER_FAMILIES = ("kvferry_router_first_token", "kvferry_router_migrations",
                   "kvferry_router_retries", "kvferry_router_errors",
                   "kvferry_router_push_prefill_failures")


def router_counters(url: str) -> dict[str, float]:
    """The router's first-token, migration, retry and error counters, by label set."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if fam.name in ROUTER_FAMILIES:
            for smp in fam.samples:
                if smp.name.endswith("_total"):
                    labels = ",".join(f"{k}={v}" for k, v in sorted(smp.labels.items()))
                    out[f"{smp.name}{{{labels}}}"] = smp.value
    return out


_WRITE = re.compile(r"kvferry WRITE (\S+): (\d+) B in (\d+) descriptors, ([\d.]+) ms; "
                    r"done ([\d.na]+) ms after")


def _raw_points(raw: Path) -> list[tuple[tuple, str, dict]]:
    """The bench's per-request lines that went through the router: ((target, input_len,
    qps), transfer id, line)."""
    out = []
    for ln in raw.read_text().splitlines() if raw.exists() else []:
        r = json.loads(ln)
        if (tid := (r.get("headers") or {}).get("x-kvferry-transfer-id")):
            out.append(((r["target"], r["input_len"], r["qps"]), tid, r))
    return out


def p_writes(p_log: str) -> dict[str, tuple[int, int, float]]:
    """Transfer id -> (bytes, descriptors, ms from post to done) of P's completed WRITEs."""
    return {m[1]: (int(m[2]), int(m[3]), float(m[4])) for m in _WRITE.finditer(p_log)}


def write_costs(raw: Path, writes: dict[str, tuple[int, int, float]]) -> list[dict]:
    """Per bench point, P's completed WRITEs: descriptors, bytes and time (post -> done);
    across all of the stack's WRITEs, a least-squares cost per descriptor and per GB: where
    a WRITE's time goes (issue #20: the layer-wise WRITEs that completed ~200 ms late)."""
    import numpy as np

    groups: dict[tuple, list[tuple[int, int, float]]] = {}
    for point, tid, _ in _raw_points(raw):
        if tid in writes:
            groups.setdefault(point, []).append(writes[tid])
    out = []
    for (target, input_len, qps), ws in sorted(groups.items()):
        b, d, ms = (np.array(x, dtype=float) for x in zip(*ws, strict=True))
        out.append({"experiment": "write_cost", "target": target, "input_len": input_len,
                    "qps": qps, "writes": len(ws),
                    "descriptors_p50": float(np.median(d)), "bytes_p50": float(np.median(b)),
                    "write_ms_p50": round(float(np.median(ms)), 2),
                    "write_ms_p90": round(float(np.percentile(ms, 90)), 2)})
    every = [w for ws in groups.values() for w in ws]
    if len(every) >= 4 and len({w[1] for w in every}) > 1:  # descriptor counts that vary
        b, d, ms = (np.array(x, dtype=float) for x in zip(*every, strict=True))
        fit = np.linalg.lstsq(np.stack([d, b / 1e9, np.ones_like(d)], 1), ms, rcond=None)[0]
        out.append({"experiment": "write_cost_fit", "writes": len(every),
                    "targets": sorted({k[0] for k in groups}),
                    "us_per_descriptor": round(float(fit[0]) * 1e3, 3),
                    "ms_per_gb": round(float(fit[1]), 3), "ms_fixed": round(float(fit[2]), 3),
                    "formula": "write_ms = descriptors*us/1e3 + GB*ms_per_gb + ms_fixed"})
    return out


HISTOGRAMS = {"vllm:time_to_first_token_seconds": "ttft",  # API server: arrival -> first token
              "vllm:request_queue_time_seconds": "queue",  # engine: queued -> scheduled
              "vllm:request_prefill_time_seconds": "first_step",  # scheduled -> first token
              "vllm:e2e_request_latency_seconds": "e2e"}


def scrape(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of vLLM's request-latency histograms on one engine."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, tuple[float, float]] = {}
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return out
    for fam in text_string_to_metric_families(text):
        # the parser may strip the unit suffix from a family's name
        key = HISTOGRAMS.get(fam.name) or HISTOGRAMS.get(fam.name + "_seconds")
        if key:
            tot = cnt = 0.0
            for smp in fam.samples:
                if smp.name.endswith("_sum"):
                    tot += smp.value
                elif smp.name.endswith("_count"):
                    cnt += smp.value
            out[key] = (tot, cnt)
    return out


def means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
          ) -> dict[str, float]:
    """Mean ms per request between two scrapes (warm-up requests included)."""
    out = {}
    for key, (tot, cnt) in after.items():
        t0, c0 = before.get(key, (0.0, 0.0))
        if cnt > c0:
            out[f"{key}_ms_mean"] = round((tot - t0) / (cnt - c0) * 1e3, 2)
    return out


def push_timeline(raw: Path, texts: list[str], meta: dict,
                  writes: dict[str, tuple[int, int, float]] | None = None) -> list[dict]:
    """Median gaps between a push request's events (connectors/protocol/timeline.py), per bench
    point: which part of the handoff is the WRITE, a notification, an engine step."""
    marks = timeline.parse(ln for text in texts for ln in text.splitlines())
    groups: dict[tuple, dict[str, dict[str, float]]] = {}
    for point, tid, r in _raw_points(raw):
        if tid in marks and "dispatched" in marks[tid]:
            groups.setdefault(point, {})[tid] = marks[tid]
            marks[tid]["client_handoff_ms"] = r.get("handoff_ms") or float("nan")
            for event, key in (("client_sent", "sent_unix"), ("client_first_byte", "first_unix")):
                if r.get(key) is not None:
                    marks[tid][event] = r[key]
    if (per_request := os.environ.get("KVFERRY_TIMELINE_REQUESTS")):  # every request's marks
        with open(per_request, "a") as f:
            for (target, input_len, qps), g in sorted(groups.items()):
                for tid, m in g.items():
                    w = (writes or {}).get(tid)
                    cost = {} if w is None else {"write_bytes": w[0], "write_descriptors": w[1],
                                                 "write_ms": w[2]}
                    f.write(json.dumps({**meta, "experiment": "push_timeline_requests",
                                        "target": target, "input_len": input_len, "qps": qps,
                                        "transfer_id": tid, **m, **cost}) + "\n")
    out = []
    for (target, input_len, qps), g in sorted(groups.items()):
        hand = sorted(m.pop("client_handoff_ms") for m in g.values())
        out.append({"target": target, "input_len": input_len, "qps": qps,
                    "client_handoff_ms_p50": round(hand[len(hand) // 2], 2),
                    **timeline.summarize(g)})
    return out


def serving_args(input_len: str, qps: str, num_requests: int, budget_s: float
                 ) -> argparse.ArgumentParser:
    """The options every serving driver shares (what `bench` needs)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--input-len", default=input_len)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--qps", default=qps)
    ap.add_argument("--num-requests", type=int, default=num_requests)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=budget_s)
    return ap


ENGINE_ARGS = ("--max-model-len", "20000", "--no-enable-prefix-caching",
               "--gpu-memory-utilization", "0.85")


def main() -> int:
    ap = serving_args("4096,16384", "2,8", 16, 240)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--only-vllm", action="store_true")
    ap.add_argument("--vllm-modes", default="pull,push", help="vLLM connectors to run")
    ap.add_argument("--eager", action="store_true", help="engines without CUDA graphs")
    ap.add_argument("--backend", default="cuda", help="cpu: a local smoke run of this driver")
    ap.add_argument("--one-gpu", action="store_true",
                    help="P and D share GPU 0 (40 GiB of KV each): when one GPU is lent")
    ap.add_argument("--layerwise", action="store_true",
                    help="then a second kvferry stack with layer-wise push (push only)")
    ap.add_argument("--only-layerwise", action="store_true", help="only that stack")
    ap.add_argument("--block-size", type=int, default=0,
                    help="engines' KV block size in tokens (vLLM's default if 0); kvferry "
                         "targets are named with -bs<N>")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    model = str(write_model(tmp / args.shape, args.shape))
    engine_args = ENGINE_ARGS + (("--enforce-eager",) if args.eager else ())
    args.hardware = "cpu" if args.backend == "cpu" else "h200x1" if args.one_gpu else "h200x2"
    if args.one_gpu:  # a fixed KV size: two engines profiling at once confuse vLLM's budget
        engine_args = ("--max-model-len", "20000", "--no-enable-prefix-caching",
                       *shared_device_args(40))  # the second engine's free-memory check too
    if args.backend == "cpu":
        engine_args = ("--max-model-len", "4096", "--no-enable-prefix-caching")
    if args.block_size:  # fewer, larger blocks: fewer WRITE descriptors (issue #20)
        engine_args += ("--block-size", str(args.block_size))
    if not args.only_vllm and not args.only_layerwise:
        run_kvferry(args, model, tmp, engine_args)
    if not args.only_vllm and (args.layerwise or args.only_layerwise):
        run_kvferry(args, model, tmp, engine_args, layerwise=True)
    for mode in [] if args.skip_vllm else args.vllm_modes.split(","):
        t0 = time.monotonic()
        with pd_stack(model, tmp / f"logs-vllm-{mode}", connector="vllm-nixl", backend="cuda",
                      engine_args=engine_args, mode=mode) as s:
            print(f"vLLM {mode} stack up in {time.monotonic() - t0:.0f}s", flush=True)
            bench([f"vllm-{mode}={s.router},impl=vllm-0.26.0,mode={mode}"], args, "push_vs_pull")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
