"""Evaluation report: summary rows with Wilson / bootstrap CIs, JSON, Markdown tables and an accuracy-vs-bytes plot.

    >>> rows = summarize_records(records)
    >>> paths = write_report(records, "results/run1", meta=meta, plans=plans)   # results.{json,md,png}

One summary row per (setting, length, task, method, budget) with n, the mean score and its 95% interval,
the *measured* cache bytes (mean over examples) and the ratio against a 16-bit cache of the same tokens
(the paper's base) and against the model's own dtype. Task ``"avg"`` rows average the per-task means
(the issue's "averaged over tasks"); their 95% interval is a stratified bootstrap (each task's examples
resampled on their own, task means averaged), so tasks with different n weigh equally, as in the mean.
The paired rows (:mod:`moend_fx.eval.paired`) compare every method with the full cache on the same examples.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moend_fx.common.errors import MoendError
from moend_fx.common.io import atomic_save_figure, atomic_write_text
from moend_fx.eval.paired import paired_accuracy
from moend_fx.eval.report_markdown import (
    BASELINES,
    headline,
    markdown_continuation,
    markdown_continuation_paired,
    markdown_headline,
    markdown_paired,
    markdown_report,
    markdown_tables,
)
from moend_fx.eval.summary import (
    AVG,
    METHOD_ORDER,
    mean_or_none,
    paired_continuation,
    stratified_bootstrap,
    summarize_continuation,
    summarize_records,
)

# Summary rows (moend_fx.eval.summary) and Markdown (moend_fx.eval.report_markdown) are part of this API.
__all__ = ["AVG", "BASELINES", "METHOD_ORDER", "headline", "load_records", "markdown_continuation",
           "markdown_continuation_paired", "markdown_paired", "paired_accuracy", "paired_continuation",
           "markdown_headline", "markdown_report", "markdown_tables", "plot_accuracy_vs_bytes",
           "stratified_bootstrap", "summarize_continuation", "summarize_records", "write_report"]


# --------------------------------------------------------------------------------------------- plot


def plot_accuracy_vs_bytes(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """PNG: task-averaged accuracy vs measured cache bytes, one panel per (setting, length)."""

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    avg = [r for r in rows if r["task"] == AVG and r["mean"] is not None]
    if not avg:
        avg = [r for r in rows if r["mean"] is not None]
    panels = sorted({(r["setting"], r["target_length"]) for r in avg})
    if not panels:
        raise MoendError("nothing to plot: no scored rows")
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    methods = sorted({r["method"] for r in avg})
    cmap = plt.get_cmap("tab10")
    for ax, (setting, length) in zip(axes[0], panels):
        rs = [r for r in avg if (r["setting"], r["target_length"]) == (setting, length)]
        for i, m in enumerate(methods):
            pts = sorted((r["measured_bytes"] / 1e6, 100 * r["mean"]) for r in rs if r["method"] == m)
            if not pts:
                continue
            xs, ys = zip(*pts)
            # Distinct markers: identical plans (e.g. greedy and exact) otherwise hide each other's points.
            style = dict(marker="os^vDP*Xph"[i % 10], markersize=7 - (i % 3), color=cmap(i % 10), label=m,
                         alpha=0.85)
            ax.plot(xs, ys, linestyle="-" if len(pts) > 1 else "none", **style)
        full16 = mean_or_none([r["full16_bytes"] for r in rs])
        if full16:
            for ratio in (4, 8, 14):
                ax.axvline(full16 / ratio / 1e6, color="0.85", linewidth=0.8, zorder=0)
        ax.set_xscale("log")
        ax.set_xlabel("measured KV-cache MB (log); grey lines: 1/4, 1/8, 1/14 of 16-bit")
        ax.set_ylabel("accuracy % (task average)")
        ax.set_ylim(-3, 103)
        ax.set_title(f"{setting}, {length} tokens")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    return atomic_save_figure(fig, path, dpi=110)


# --------------------------------------------------------------------------------------------- files


def write_report(records: Sequence[dict[str, Any]], out_dir: str | Path, *, meta: dict[str, Any] | None = None,
                 plans: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
                 continuation: Sequence[dict[str, Any]] | None = None, reference: str = "full") -> dict[str, Path]:
    """Write results.json (meta, summary rows, each method paired with ``reference`` on the same examples,
    plans, records; continuation KL rows if given), results.md and accuracy_vs_bytes.png (only when there are
    task records: a continuation-only run has none)."""
    if not records and not continuation:
        raise MoendError("no records to report")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize_records(records)
    paired = paired_accuracy(records, reference)
    doc = {"format": "moend_fx.eval", "version": 1, "meta": meta or {}, "summary": rows, "paired": paired,
           "plans": plans or {}, "records": list(records), **(extra or {})}
    md = markdown_report(rows, meta, paired) if records else ""
    if continuation:
        doc["continuation"] = {"summary": summarize_continuation(continuation),
                               "paired": paired_continuation(continuation), "records": list(continuation)}
        md += (("\n" if md else "") + markdown_continuation(doc["continuation"]["summary"]) + "\n"
               + markdown_continuation_paired(doc["continuation"]["paired"]))
    paths = {
        "json": atomic_write_text(out / "results.json", json.dumps(doc, indent=1, default=str)),
        "md": atomic_write_text(out / "results.md", md),
    }
    if records:
        paths["png"] = plot_accuracy_vs_bytes(rows, out / "accuracy_vs_bytes.png")
    return paths


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """Records from a results.json or a records.jsonl."""
    p = Path(path)
    text = p.read_text()
    if p.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    doc = json.loads(text)
    if doc.get("format") != "moend_fx.eval":
        raise MoendError(f"{p} is not a moend_fx.eval results file (format {doc.get('format')!r})")
    return doc["records"]
