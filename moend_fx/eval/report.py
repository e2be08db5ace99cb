"""Evaluation report: summary rows with Wilson / bootstrap CIs, JSON, Markdown tables and an accuracy-vs-bytes plot.

    >>> rows = summarize_records(records)
    >>> paths = write_report(records, "results/run1", meta=meta, plans=plans)   # results.{json,md,png}

One summary row per (setting, length, task, method, budget) with n, the mean score and its 95% interval,
the *measured* cache bytes (mean over examples) and the ratio against a 16-bit cache of the same tokens
(the paper's base) and against the model's own dtype. Task ``"avg"`` rows average the per-task means
(the issue's "averaged over tasks"); their 95% interval is a stratified bootstrap (each task's examples
resampled on their own, task means averaged), so tasks with different n weigh equally, as in the mean.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from moend_fx.common.errors import MoendError
from moend_fx.common.io import atomic_save_figure, atomic_write_text
from moend_fx.eval.stats import summarize
from moend_fx.plan.memory import format_bytes

AVG = "avg"
# Row order in tables: references first, then the paper's ablation chain (== moend_fx.eval.methods.METHODS).
METHOD_ORDER = ("full", "hf_quant4", "hf_fp8", "lossless", "1d", "2d_uniform", "2d", "pyramid", "2d_hetero",
                "2d_hetero_exact")
_GROUP = ("setting", "target_length", "task", "method", "budget")


def _mean(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Summary rows (dicts), per task and averaged over tasks (task = "avg"), sorted for reading."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        missing = [k for k in _GROUP if k not in r]
        if missing:
            raise MoendError(f"record lacks field(s) {missing}; is it from moend_fx.eval.runner?")
        groups[tuple(r[k] for k in _GROUP)].append(r)
    rows = []
    for key, rs in groups.items():
        row = dict(zip(_GROUP, key))
        scored = [r for r in rs if r.get("score") is not None]
        row["n"] = len(scored)
        row["infeasible"] = len(rs) - len(scored)
        row["infeasible_reason"] = next((r.get("infeasible") for r in rs if r.get("infeasible")), None)
        if scored:
            s = summarize([r["score"] for r in scored])
            row.update(mean=s.mean, low=s.low, high=s.high, ci=s.method)
        else:
            row.update(mean=None, low=None, high=None, ci=None)
        for f in ("measured_bytes", "ratio16", "ratio_model", "budget_bytes", "full16_bytes", "full_model_bytes",
                  "context_tokens", "decode_s", "new_tokens", "predicted_loss"):
            row[f] = _mean([r.get(f) for r in scored] if f not in ("budget_bytes", "full16_bytes", "context_tokens",
                                                                   "full_model_bytes") else [r.get(f) for r in rs])
        row["shared"] = sorted({r["shared_with"] for r in rs if r.get("shared_with")})
        rows.append(row)
    rows += _averages(rows, groups)
    order = {m: i for i, m in enumerate(METHOD_ORDER)}
    rows.sort(key=lambda r: (r["setting"], r["target_length"], _budget_key(r["budget"]),
                             order.get(r["method"], len(order)), r["method"], r["task"] == AVG, r["task"]))
    return rows


def _budget_key(b: str | None) -> float:
    if b is None:
        return -1.0
    try:
        return float(str(b).rstrip("xX"))
    except ValueError:
        return math.inf


def stratified_bootstrap(per_task: Sequence[Sequence[float]], n_boot: int = 2000, seed: int = 0,
                         level: float = 0.95) -> tuple[float, float, float]:
    """(mean of the task means, low, high): each bootstrap replicate resamples every task's examples on its own
    and averages the task means, so tasks with different n weigh equally, as in the point estimate."""
    import numpy as np

    rng = np.random.default_rng(seed)
    arrays = [np.asarray(xs, dtype=np.float64) for xs in per_task]
    point = float(np.mean([a.mean() for a in arrays]))
    reps = np.mean([a[rng.integers(0, a.size, size=(n_boot, a.size))].mean(axis=1) for a in arrays], axis=0)
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(reps, [alpha, 1.0 - alpha])
    return point, float(lo), float(hi)


def _averages(rows: list[dict[str, Any]], groups: dict[tuple, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    by: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by[(r["setting"], r["target_length"], r["method"], r["budget"])].append(r)
    out = []
    for (setting, length, method, budget), rs in by.items():
        tasks = sorted(r["task"] for r in rs)
        feasible = [r for r in rs if r["mean"] is not None]
        row = dict(setting=setting, target_length=length, task=AVG, method=method, budget=budget,
                   tasks=tasks, n=sum(r["n"] for r in rs), infeasible=sum(r["infeasible"] for r in rs),
                   infeasible_reason=next((r["infeasible_reason"] for r in rs if r["infeasible_reason"]), None))
        if len(feasible) == len(rs):
            per_task = [[rec["score"] for rec in groups[(setting, length, t, method, budget)]
                         if rec.get("score") is not None] for t in tasks]
            mean, lo, hi = stratified_bootstrap(per_task)
            row.update(mean=mean, low=lo, high=hi, ci="stratified bootstrap")
        else:
            row.update(mean=None, low=None, high=None, ci=None)
        for f in ("measured_bytes", "ratio16", "ratio_model", "budget_bytes", "full16_bytes", "full_model_bytes",
                  "context_tokens", "decode_s", "new_tokens", "predicted_loss"):
            row[f] = _mean([r[f] for r in rs])
        row["shared"] = sorted({s for r in rs for s in r["shared"]})
        out.append(row)
    return out


# --------------------------------------------------------------------------------------------- Markdown


def _pct(row: dict[str, Any]) -> str:
    if row["mean"] is None:
        return "infeasible" if row["infeasible"] else "-"
    return f"{100 * row['mean']:.1f} [{100 * row['low']:.0f}, {100 * row['high']:.0f}]"


def _label(row: dict[str, Any]) -> str:
    return row["method"] if row["budget"] is None else f"{row['method']} @ {row['budget']}"


def markdown_tables(rows: Sequence[dict[str, Any]]) -> str:
    """One table per (setting, length): rows = method @ budget, columns = tasks + avg + measured memory."""
    out = []
    by: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by[(r["setting"], r["target_length"])].append(r)
    for (setting, length), rs in sorted(by.items()):
        tasks = sorted({r["task"] for r in rs if r["task"] != AVG})
        ns = sorted({r["n"] for r in rs if r["task"] != AVG and r["mean"] is not None})
        ctx = _mean([r["context_tokens"] for r in rs])
        out.append(f"### {setting}, {length} tokens (context ~{ctx:.0f} tokens compressed; n per task = "
                   f"{'/'.join(map(str, ns))}; accuracy % [Wilson 95% CI])\n")
        cols = [*tasks, "avg"] if len(tasks) > 1 else tasks
        out.append("| method @ budget | " + " | ".join(cols) +
                   " | measured cache | x vs 16-bit | x vs model dtype |")
        out.append("|---|" + "---:|" * (len(cols) + 3))
        labels: dict[str, dict[str, dict[str, Any]]] = {}
        for r in rs:
            labels.setdefault(_label(r), {})[r["task"]] = r
        for label, cells in labels.items():
            avg = cells.get(AVG) or next(iter(cells.values()))
            mem = (f"{format_bytes(avg['measured_bytes'])}" if avg["measured_bytes"] is not None else "-")
            r16 = f"{avg['ratio16']:.2f}" if avg["ratio16"] is not None else "-"
            rm = f"{avg['ratio_model']:.2f}" if avg["ratio_model"] is not None else "-"
            vals = [_pct(cells[c if c != "avg" else AVG]) if (c if c != "avg" else AVG) in cells else "-"
                    for c in cols]
            out.append(f"| {label} | " + " | ".join(vals) + f" | {mem} | {r16} | {rm} |")
        shared = sorted({f"{_label(r)} = {s}" for r in rs if r["task"] == AVG for s in r["shared"]})
        if shared:
            out.append("\nPlans that coincided in at least one example (one decode there, reported under both "
                       "names): " + "; ".join(shared) + ".")
        out.append("")
    return "\n".join(out)


BASELINES = ("1d", "2d_uniform", "2d", "pyramid")


def headline(rows: Sequence[dict[str, Any]], method: str = "2d_hetero") -> list[dict[str, Any]]:
    """Per (setting, length, budget): ``method``'s task-averaged accuracy vs the full cache and vs the best of
    the uniform baselines at the same budget (the issue's acceptance test), with measured bytes."""
    avg = {(r["setting"], r["target_length"], r["method"], r["budget"]): r for r in rows if r["task"] == AVG}
    out = []
    for (setting, length, m, budget), r in sorted(avg.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                               _budget_key(kv[0][3]))):
        if m != method or r["mean"] is None:
            continue
        full = avg.get((setting, length, "full", None))
        base = [avg[(setting, length, b, budget)] for b in BASELINES if (setting, length, b, budget) in avg]
        feasible = [b for b in base if b["mean"] is not None]
        best = max(feasible, key=lambda b: b["mean"]) if feasible else None
        out.append(dict(
            setting=setting, target_length=length, budget=budget, method=method, mean=r["mean"],
            measured_bytes=r["measured_bytes"], ratio16=r["ratio16"],
            full=full["mean"] if full else None,
            vs_full=(r["mean"] - full["mean"]) if full else None,
            best_baseline=best["method"] if best else None, best_baseline_mean=best["mean"] if best else None,
            best_baseline_bytes=best["measured_bytes"] if best else None,
            vs_best=(r["mean"] - best["mean"]) if best else None,
            infeasible_baselines=[b["method"] for b in base if b["mean"] is None],
        ))
    return out


def markdown_headline(rows: Sequence[dict[str, Any]], method: str = "2d_hetero") -> str:
    hs = headline(rows, method)
    if not hs:
        return ""
    lines = [f"### {method} vs the full cache and the best uniform baseline at the same budget (task average)\n",
             "| setting | length | budget | " + method + " | measured | full | delta vs full | best baseline | "
             "its measured | delta vs best |", "|---|---:|---|---:|---:|---:|---:|---|---:|---:|"]

    def pts(x):
        return "-" if x is None else f"{100 * x:+.1f}"

    for h in hs:
        full = "-" if h["full"] is None else f"{100 * h['full']:.1f}"
        best = (f"{h['best_baseline']} {100 * h['best_baseline_mean']:.1f}" if h["best_baseline"] else "none feasible")
        if h["infeasible_baselines"]:
            best += f" ({', '.join(h['infeasible_baselines'])} infeasible)"
        lines.append(
            f"| {h['setting']} | {h['target_length']} | {h['budget']} | {100 * h['mean']:.1f} | "
            f"{format_bytes(h['measured_bytes'])} ({h['ratio16']:.1f}x) | "
            f"{full} | "
            f"{pts(h['vs_full'])} | {best} | "
            f"{'-' if h['best_baseline_bytes'] is None else format_bytes(h['best_baseline_bytes'])} | "
            f"{pts(h['vs_best'])} |")
    return "\n".join(lines) + "\n"


def markdown_report(rows: Sequence[dict[str, Any]], meta: dict[str, Any] | None = None) -> str:
    meta = meta or {}
    head = ["# Evaluation results", ""]
    cfg = meta.get("config", {})
    if cfg:
        head.append(f"Tasks {', '.join(cfg.get('tasks', []))}; lengths {cfg.get('lengths')}; n = {cfg.get('n')} per "
                    f"task and length; seed {cfg.get('seed')}; greedy decoding, strict string match.")
    head += [
        "Budgets are ratios of a **16-bit** cache of the example's compressed tokens (design.md); memory is the "
        "*measured* bytes of the cache after prefill + compression (packed codes, scales/zeros, positions, "
        "residual window). `x vs model dtype` is against the model's own (fp32) cache, labelled separately.",
        "",
    ]
    skipped = meta.get("skipped_methods") or {}
    for name, why in skipped.items():
        head.append(f"- Not run: `{name}`: {why}.")
    if skipped:
        head.append("")
    return "\n".join(head) + "\n" + markdown_headline(rows) + "\n" + markdown_tables(rows)


def summarize_continuation(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows per (context length, method, budget): mean KL(full || method), mean loss and the full cache's loss,
    measured bytes and ratios, over the sequences (records from ``runner.continuation_eval``)."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[(r.get("context_length", r["context_tokens"]), r["method"], r["budget"])].append(r)
    order = {m: i for i, m in enumerate(METHOD_ORDER)}
    rows = []
    for (length, method, budget), rs in groups.items():
        ok = [r for r in rs if r.get("kl") is not None]
        rows.append(dict(context_length=length, method=method, budget=budget, n=len(ok),
                         infeasible=len(rs) - len(ok), kl=_mean([r["kl"] for r in ok]),
                         loss=_mean([r["loss"] for r in ok]), loss_full=_mean([r["loss_full"] for r in rs]),
                         measured_bytes=_mean([r["measured_bytes"] for r in ok]),
                         ratio16=_mean([r.get("ratio16") for r in ok]),
                         continuation_tokens=_mean([r["continuation_tokens"] for r in rs])))
    rows.sort(key=lambda r: (r["context_length"], _budget_key(r["budget"]), order.get(r["method"], len(order))))
    return rows


def markdown_continuation(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return ""
    out = ["### Teacher-forced continuation on held-out text (mean over sequences)\n",
           "| context | method @ budget | n | KL from full, nats/token | loss (full) | measured | x vs 16-bit |",
           "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["kl"] is None:
            out.append(f"| {r['context_length']} | {_label(r)} | 0 | infeasible | - | - | - |")
            continue
        out.append(f"| {r['context_length']} | {_label(r)} | {r['n']} | {r['kl']:.4f} | {r['loss']:.3f} "
                   f"({r['loss_full']:.3f}) | {format_bytes(r['measured_bytes'])} | {r['ratio16']:.2f} |")
    return "\n".join(out) + "\n"


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
        full16 = _mean([r["full16_bytes"] for r in rs])
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
                 continuation: Sequence[dict[str, Any]] | None = None) -> dict[str, Path]:
    """Write results.json (meta, summary rows, plans, records; continuation KL rows if given), results.md and
    accuracy_vs_bytes.png."""
    if not records:
        raise MoendError("no records to report")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize_records(records)
    doc = {"format": "moend_fx.eval", "version": 1, "meta": meta or {}, "summary": rows, "plans": plans or {},
           "records": list(records), **(extra or {})}
    md = markdown_report(rows, meta)
    if continuation:
        doc["continuation"] = {"summary": summarize_continuation(continuation), "records": list(continuation)}
        md += "\n" + markdown_continuation(doc["continuation"]["summary"])
    paths = {
        "json": atomic_write_text(out / "results.json", json.dumps(doc, indent=1, default=str)),
        "md": atomic_write_text(out / "results.md", md),
    }
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
