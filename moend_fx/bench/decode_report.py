"""Output of the decode benchmark: Markdown table, plot, JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from moend_fx.bench.decode_tables import batch_table, cache_check, compile_table, fit_table, recompile_note
from moend_fx.common.io import atomic_save_figure, atomic_write_text
from moend_fx.plan.memory import format_bytes


def _mb(x: int | None) -> str:
    return "" if x is None else f"{x / 1e6:.1f}"


def _x(x: float | None, digits: int = 2) -> str:
    return "" if x is None else f"{x:.{digits}f}x"


def markdown_table(result: dict[str, Any]) -> str:
    """The result as Markdown: the batch-1 table (unavailable rows state the reason), then, where they ran, the
    throughput by batch, the memory-model check, the largest batch under the cap and the compile times."""
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
    ]
    rows = [r for r in result["rows"] if r.get("batch", 1) == 1]
    # results written before ms_mean was recorded render as they were published
    mean = any("ms_mean" in r for r in rows)
    if "evict_every" in s:
        lines[0] += (f" MoENDCache eviction: room for min({s['evict_every']}, group size) tokens when a layer evicts, "
                     f"decode-time re-evictions drop {s['reevict']}.")
    lines += [
        "| method | context | ms/token | " + ("mean ms | " if mean else "") + "speed-up | cache | ratio 16-bit | "
        "ratio model dtype | RSS growth prefill / decode (MB) | roofline ms | x roofline |",
        "| --- | ---: | ---: | " + ("---: | " if mean else "") + "---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['method']} | {r['tokens']} | unavailable: {r['reason']} | "
                         + ("| " if mean else "") + "| | | | | | |")
            continue
        mean_cell = (f"{r['ms_mean']:.1f} | " if "ms_mean" in r else "| ") if mean else ""
        lines.append(
            f"| {r['method']} | {r['tokens']} | {r['ms_median']:.1f} | {mean_cell}{_x(r.get('speedup_vs_baseline'))} | "
            f"{format_bytes(r['cache_bytes'])} | {_x(r['cache_ratio_16bit'], 1)} | "
            f"{_x(r['cache_ratio_model_dtype'], 1)} | {_mb(r['prefill_peak_rss_growth'])} / "
            f"{_mb(r['decode_peak_rss_growth'])} | {r['roofline_ms']:.1f} | {r['x_roofline']:.2f}x |"
        )
    lines += batch_table(result) + cache_check(result) + fit_table(result) + compile_table(result)
    plans = sorted({r["plan"] for r in result["rows"] if r.get("plan")})
    if plans:
        lines += ["", "Plan(s): " + "; ".join(plans)]
    slow = [r for r in result["rows"] if r["status"] == "ok" and r.get("warmup_s", 0) > 5]
    if slow:
        lines += ["", "Warm-up (includes compilation): " + ", ".join(
            f"{r['method']} @ {r['tokens']}{'' if r.get('batch', 1) == 1 else ' x' + str(r['batch'])} "
            f"{r['warmup_s']:.0f} s" for r in slow)]
    lines += recompile_note(result)
    return "\n".join(lines) + "\n"


def plot_decode(result: dict[str, Any], path: str | os.PathLike) -> Path:
    """PNG: ms/token vs context length per method at batch 1, with each method's roofline dotted; beside it,
    when several batch sizes ran, tokens/s vs batch per method and context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in result["rows"] if r["status"] == "ok"]
    batched = len({r.get("batch", 1) for r in ok}) > 1
    fig, axes = plt.subplots(1, 2 if batched else 1, figsize=(13 if batched else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    for name in dict.fromkeys(r["method"] for r in result["rows"]):
        pts = sorted((r["tokens"], r["ms_median"], r["roofline_ms"]) for r in ok
                     if r["method"] == name and r.get("batch", 1) == 1)
        if not pts:
            continue
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.plot([p[0] for p in pts], [p[2] for p in pts], linestyle=":", color=line.get_color(), alpha=0.7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("ms per decode step (median), batch 1")
    ax.set_ylim(bottom=0)
    ax.set_title(f"decode on CPU, {result['meta']['threads']} threads (dotted: roofline)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if batched:
        _plot_batches(axes[0][1], ok)
    return atomic_save_figure(fig, path)


def _plot_batches(ax: Any, ok: list[dict[str, Any]]) -> None:
    for key in dict.fromkeys((r["method"], r["tokens"]) for r in ok):
        pts = sorted((r.get("batch", 1), r["tokens_per_s"]) for r in ok if (r["method"], r["tokens"]) == key)
        if len(pts) > 1:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]} @ {key[1]}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s (all rows)")
    ax.set_ylim(bottom=0)
    ax.set_title("decode throughput by batch")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


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
