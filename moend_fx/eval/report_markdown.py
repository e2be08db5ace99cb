"""The evaluation report in Markdown: one table per (setting, length), the headline comparison, continuation KL."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from moend_fx.eval.summary import AVG, budget_key, mean_or_none
from moend_fx.plan.memory import format_bytes


def _pct(row: dict[str, Any]) -> str:
    if row["mean"] is None:
        return "infeasible" if row["infeasible"] else "-"
    return f"{100 * row['mean']:.1f} [{100 * row['low']:.0f}, {100 * row['high']:.0f}]"


def _peak(row: dict[str, Any], prefix: str = "") -> str:
    """``row``'s mean peak bytes and ratio (``{prefix}peak_bytes``, ``{prefix}peak_ratio16``); "-" when its
    records predate the peak measurement."""
    b, r = row.get(f"{prefix}peak_bytes"), row.get(f"{prefix}peak_ratio16")
    return "-" if b is None or r is None else f"{format_bytes(b)} ({r:.1f}x)"


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
        ctx = mean_or_none([r["context_tokens"] for r in rs])
        out.append(f"### {setting}, {length} tokens (context ~{ctx:.0f} tokens compressed; n per task = "
                   f"{'/'.join(map(str, ns))}; accuracy % [Wilson 95% CI])\n")
        cols = [*tasks, "avg"] if len(tasks) > 1 else tasks
        out.append("| method @ budget | " + " | ".join(cols) +
                   " | measured cache | x vs 16-bit | x vs model dtype | peak cache (x vs 16-bit) |")
        out.append("|---|" + "---:|" * (len(cols) + 4))
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
            out.append(f"| {label} | " + " | ".join(vals) + f" | {mem} | {r16} | {rm} | {_peak(avg)} |")
        shared = sorted({f"{_label(r)} = {s}" for r in rs if r["task"] == AVG for s in r["shared"]})
        if shared:
            out.append("\nPlans that coincided in at least one example (one decode there, reported under both "
                       "names): " + "; ".join(shared) + ".")
        out.append("")
    return "\n".join(out)


BASELINES = ("1d", "2d_uniform", "2d_uniform_matched", "2d", "pyramid")


def headline(rows: Sequence[dict[str, Any]], method: str = "2d_hetero") -> list[dict[str, Any]]:
    """Per (setting, length, budget): ``method``'s task-averaged accuracy vs the full cache and vs the best of
    the uniform baselines at the same budget (the issue's acceptance test), with measured bytes."""
    avg = {(r["setting"], r["target_length"], r["method"], r["budget"]): r for r in rows if r["task"] == AVG}
    out = []
    for (setting, length, m, budget), r in sorted(avg.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                               budget_key(kv[0][3]))):
        if m != method or r["mean"] is None:
            continue
        full = avg.get((setting, length, "full", None))
        base = [avg[(setting, length, b, budget)] for b in BASELINES if (setting, length, b, budget) in avg]
        feasible = [b for b in base if b["mean"] is not None]
        best = max(feasible, key=lambda b: b["mean"]) if feasible else None
        out.append(dict(
            setting=setting, target_length=length, budget=budget, method=method, mean=r["mean"],
            measured_bytes=r["measured_bytes"], ratio16=r["ratio16"], peak_bytes=r.get("peak_bytes"),
            peak_ratio16=r.get("peak_ratio16"),
            full=full["mean"] if full else None,
            vs_full=(r["mean"] - full["mean"]) if full else None,
            best_baseline=best["method"] if best else None, best_baseline_mean=best["mean"] if best else None,
            best_baseline_bytes=best["measured_bytes"] if best else None,
            best_peak_bytes=best.get("peak_bytes") if best else None,
            best_peak_ratio16=best.get("peak_ratio16") if best else None,
            vs_best=(r["mean"] - best["mean"]) if best else None,
            infeasible_baselines=[b["method"] for b in base if b["mean"] is None],
        ))
    return out


def markdown_headline(rows: Sequence[dict[str, Any]], method: str = "2d_hetero") -> str:
    hs = headline(rows, method)
    if not hs:
        return ""
    lines = [f"### {method} vs the full cache and the best uniform baseline at the same budget (task average)\n",
             "| setting | length | budget | " + method + " | measured | peak | full | delta vs full | best baseline | "
             "its measured | its peak | delta vs best |", "|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]

    def pts(x):
        return "-" if x is None else f"{100 * x:+.1f}"

    for h in hs:
        full = "-" if h["full"] is None else f"{100 * h['full']:.1f}"
        best = (f"{h['best_baseline']} {100 * h['best_baseline_mean']:.1f}" if h["best_baseline"]
                else "none feasible" if h["infeasible_baselines"] else "none run")
        if h["infeasible_baselines"]:
            best += f" ({', '.join(h['infeasible_baselines'])} infeasible)"
        lines.append(
            f"| {h['setting']} | {h['target_length']} | {h['budget']} | {100 * h['mean']:.1f} | "
            f"{format_bytes(h['measured_bytes'])} ({h['ratio16']:.1f}x) | {_peak(h)} | "
            f"{full} | "
            f"{pts(h['vs_full'])} | {best} | "
            f"{'-' if h['best_baseline_bytes'] is None else format_bytes(h['best_baseline_bytes'])} | "
            f"{_peak(h, 'best_')} | {pts(h['vs_best'])} |")
    return "\n".join(lines) + "\n"


def _table(title: str, columns: Sequence[str], aligns: str, lines: Sequence[str]) -> str:
    """A titled Markdown table; ``aligns``: one character per column, ``l`` (left) or ``r`` (right)."""
    rule = "|" + "".join("---|" if a == "l" else "---:|" for a in aligns)
    return "\n".join([f"{title}\n", "| " + " | ".join(columns) + " |", rule, *lines]) + "\n"


def markdown_paired(rows: Sequence[dict[str, Any]]) -> str:
    """The paired table (:func:`moend_fx.eval.paired.paired_accuracy` rows); empty when there are none."""
    if not rows:
        return ""
    ref = rows[0]["reference"]
    lines = []
    for r in rows:
        notes = [f"{r['unpaired']} unpaired"] * bool(r["unpaired"]) + [f"{r['cross_run']} across runs"] * bool(
            r.get("cross_run"))
        n = f"{r['n']}" + (f" ({', '.join(notes)})" if notes else "")
        lines.append(f"| {r['setting']} | {r['target_length']} | {_label(r)} | {n} | {100 * r['mean']:.1f} | "
                     f"{100 * r['reference_mean']:.1f} | {100 * r['diff']:+.1f} [{100 * r['low']:+.0f}, "
                     f"{100 * r['high']:+.0f}] | {r['better']} / {r['worse']} |")
    return _table(f"### Paired with `{ref}`: the same examples (task average; difference with its 95% stratified "
                  "bootstrap interval; examples better / worse)",
                  ["setting", "length", "method @ budget", "n", "accuracy", ref, "difference [95%]",
                   "better / worse"], "lrlrrrrr", lines)


def _seeds(cfg: dict[str, Any]) -> str:
    seeds = cfg.get("seeds")
    if seeds and len(seeds) > 1:
        return f"seeds {', '.join(map(str, seeds))}"
    return f"seed {seeds[0] if seeds else cfg.get('seed')}"


def coverage(rows: Sequence[dict[str, Any]]) -> str:
    """What a report's rows cover, length by length: ``"2048 tokens: niah_single, passkey (n = 30 per task); 7900
    tokens: niah_single (n = 20 per task)"`` (runs of several parts, or pooled runs, differ in tasks and n by
    length). rows: summary rows; the task averages and cells with no result are left out."""
    per: dict[int, dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))
    for r in rows:
        if r["task"] != AVG and r["mean"] is not None:
            per[r["target_length"]][r["task"]].add(r["n"])
    out = []
    for length, tasks in sorted(per.items()):
        ns = sorted(set().union(*tasks.values()))
        out.append(f"{length} tokens: {', '.join(sorted(tasks))} (n = {'/'.join(map(str, ns))} per task)")
    return "; ".join(out)


def markdown_report(rows: Sequence[dict[str, Any]], meta: dict[str, Any] | None = None,
                    paired: Sequence[dict[str, Any]] = ()) -> str:
    meta = meta or {}
    head = ["# Evaluation results", ""]
    cfg = meta.get("config", {})
    if cfg:
        head.append(f"{coverage(rows) or 'No results yet'}; {_seeds(cfg)}; greedy decoding, strict string match.")
    head += [
        "Budgets are ratios of a **16-bit** cache of the example's compressed tokens (design.md); memory is the "
        "*measured* bytes of the cache after prefill + compression (packed codes, scales/zeros, positions, "
        "residual window, eviction state), and its *peak*: the most it held after any step of the question and "
        "answer (a capacity-mode cache leaves room after the prompt that they fill; a full cache grows with "
        "them), against the same 16-bit cache of the prompt's tokens. `x vs model dtype` is against the model's "
        "own (fp32) cache, labelled separately.",
        "",
    ]
    skipped = meta.get("skipped_methods") or {}
    for name, why in skipped.items():
        head.append(f"- Not run: `{name}`: {why}.")
    if skipped:
        head.append("")
    paired_md = markdown_paired(paired)
    return ("\n".join(head) + "\n" + markdown_headline(rows) + "\n" + (paired_md + "\n" if paired_md else "")
            + markdown_tables(rows))


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


def markdown_continuation_paired(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return ""
    ref = rows[0]["reference"]
    lines = []
    for r in rows:
        rel = f"{100 * r['rel']:+.0f}%" if r["rel"] is not None else "-"
        lines.append(f"| {r['context_length']} | {r['budget']} | {r['method']} | {r['n']} | {r['diff']:+.4f} +- "
                     f"{r['diff_ci']:.4f} | {rel} | {r['ref_lower']}/{r['n']} |")
    return _table(f"#### Paired: each method's KL minus `{ref}`'s on the same sequences (> 0: `{ref}` is closer to "
                  "the full cache; +- two standard errors)",
                  ["context", "budget", "method", "n", "KL difference", "relative to the method's KL",
                   f"`{ref}` lower on"], "rllrrrr", lines)
