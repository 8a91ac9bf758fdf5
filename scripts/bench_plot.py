"""PNG of `kvferry bench` lines: TTFT p50 (solid) and p90 (dashed) per target.

Single-turn lines: x = offered QPS, one subplot per input length. Multi-turn lines
(`turn` present): x = the turn's prompt length, one subplot per (first input length, QPS).
Unsustainable points are circled in red.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any


def plot_lines(lines: Iterable[dict[str, Any]], path: Path) -> Path:
    """Write the figure for `lines` (bench-schema dicts) to `path`; returns path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in lines if r.get("ttft_ms_p50") is not None]
    multi = any("turn" in r for r in rows)
    panel_key = ((lambda r: (r.get("first_input_len"), r["qps"])) if multi
                 else (lambda r: r["input_len"]))
    x_key = (lambda r: r["input_len"]) if multi else (lambda r: r["qps"])
    panels = sorted({panel_key(r) for r in rows}) or [None]
    targets = list(dict.fromkeys(r.get("target", r.get("impl", "?")) for r in rows))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(1, len(panels), figsize=(max(7.0, 5.5 * len(panels)), 4.4), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for i, name in enumerate(targets):
            pts = sorted((r for r in rows if panel_key(r) == panel
                          and r.get("target", r.get("impl", "?")) == name), key=x_key)
            if not pts:
                continue
            c = colors[i % len(colors)]
            xs = [x_key(r) for r in pts]
            ax.plot(xs, [r["ttft_ms_p50"] for r in pts], "-o", color=c, label=f"{name} p50")
            p90 = [(x_key(r), r["ttft_ms_p90"]) for r in pts if r.get("ttft_ms_p90") is not None]
            if p90:
                ax.plot(*zip(*p90, strict=True), "--", color=c, alpha=0.7, label=f"{name} p90")
            bad = [(x_key(r), r["ttft_ms_p50"]) for r in pts if r.get("sustainable") is False]
            if bad:
                ax.scatter(*zip(*bad, strict=True), s=140, facecolors="none", edgecolors="red",
                           zorder=5)
        if multi:
            first, q = panel if panel else (None, None)
            parts = ([f"first turn {first} tok"] if first is not None else []) + \
                ([f"qps {q:g}"] if q else [])
            ax.set_title(", ".join(parts) or "one conversation at a time")
            ax.set_xlabel("turn prompt length (tokens)")
        else:
            ax.set_title(f"input {panel} tokens" if panel is not None else "no successful points")
            ax.set_xlabel("offered QPS")
        ax.set_ylabel("TTFT (ms)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    first = rows[0] if rows else {}
    fig.suptitle(f"{first.get('experiment', '')} {first.get('model', '')} {first.get('hardware', '')}"
                 f" - output {first.get('output_len', '')} tok\n(red circle: unsustainable)",
                 fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
