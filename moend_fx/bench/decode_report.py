"""Output of the decode benchmark: Markdown table, plot, JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from moend_fx.common.io import atomic_save_figure, atomic_write_text
from moend_fx.plan.memory import format_bytes


def _mb(x: int | None) -> str:
    return "" if x is None else f"{x / 1e6:.1f}"


def _x(x: float | None, digits: int = 2) -> str:
    return "" if x is None else f"{x:.{digits}f}x"


def markdown_table(result: dict[str, Any]) -> str:
    """The result as a Markdown paragraph + table (unavailable rows state the reason)."""
    meta = result["meta"]
    s = meta["settings"]
    fp = meta["model"]
    lines = [
        f"Decode on CPU: {meta['model_name']} ({fp['num_layers']} layers, {fp['num_kv_heads']} KV heads, "
        f"head_dim {fp['head_dim']}, {fp['dtype']}), {meta['threads']} threads, median of {s['steps']} steps "
        f"after {s['warmup']} warm-up, random-token context, one run. Compressed plan: {meta['plan_source']}. "
        f"Speed-up = {meta['baseline']} ms / method ms (> 1 is faster). Cache ratio = uncompressed cache of the "
        "same tokens / measured cache bytes, 16-bit base (the paper's) and model dtype. Roofline = (weights "
        f"{format_bytes(meta['weight_bytes'])} + cache) / {s['bandwidth_gbs']:g} GB/s. RSS growth = peak "
        "process RSS above the pre-prefill level (prefill / decode), an upper bound.",
        "",
        "| method | context | ms/token | speed-up | cache | ratio 16-bit | ratio model dtype | "
        "RSS growth prefill / decode (MB) | roofline ms | x roofline |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['method']} | {r['tokens']} | unavailable: {r['reason']} | | | | | | | |")
            continue
        lines.append(
            f"| {r['method']} | {r['tokens']} | {r['ms_median']:.1f} | {_x(r.get('speedup_vs_baseline'))} | "
            f"{format_bytes(r['cache_bytes'])} | {_x(r['cache_ratio_16bit'], 1)} | "
            f"{_x(r['cache_ratio_model_dtype'], 1)} | {_mb(r['prefill_peak_rss_growth'])} / "
            f"{_mb(r['decode_peak_rss_growth'])} | {r['roofline_ms']:.1f} | {r['x_roofline']:.2f}x |"
        )
    plans = sorted({r["plan"] for r in result["rows"] if r.get("plan")})
    if plans:
        lines += ["", "Plan(s): " + "; ".join(plans)]
    slow = [r for r in result["rows"] if r["status"] == "ok" and r.get("warmup_s", 0) > 5]
    if slow:
        lines += ["", "Warm-up (includes compilation): " + ", ".join(
            f"{r['method']} @ {r['tokens']} {r['warmup_s']:.0f} s" for r in slow)]
    return "\n".join(lines) + "\n"


def plot_decode(result: dict[str, Any], path: str | os.PathLike) -> Path:
    """PNG: ms/token vs context length per method, with each method's roofline dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["method"] for r in result["rows"]):
        pts = sorted((r["tokens"], r["ms_median"], r["roofline_ms"]) for r in result["rows"]
                     if r["method"] == name and r["status"] == "ok")
        if not pts:
            continue
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.plot([p[0] for p in pts], [p[2] for p in pts], linestyle=":", color=line.get_color(), alpha=0.7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("ms per decode step (median)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"decode on CPU, {result['meta']['threads']} threads (dotted: roofline)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return atomic_save_figure(fig, path)


def write_decode(result: dict[str, Any], out_dir: str | os.PathLike, *, plot: bool = True) -> dict[str, Path]:
    """Write ``decode.json``, ``decode.md`` (and ``decode.png``) into ``out_dir``."""
    out = Path(out_dir)
    paths = {
        "json": atomic_write_text(out / "decode.json", json.dumps(result, indent=1, default=str) + "\n"),
        "markdown": atomic_write_text(out / "decode.md", markdown_table(result)),
    }
    if plot and any(r["status"] == "ok" for r in result["rows"]):
        paths["plot"] = plot_decode(result, out / "decode.png")
    return paths
