"""The report of ``moend bench heads`` (:mod:`moend_fx.bench.head_budgets`): accuracy, bytes and head-count spread
per (setting, budget, variant), as JSON and Markdown."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from moend_fx.bench.head_budgets import VARIANTS, HeadBudgetSettings
from moend_fx.common.io import atomic_write_text
from moend_fx.eval.stats import summarize as summarize_scores


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (setting, budget, variant): accuracy with its Wilson 95% interval, mean bytes and ratio, the per-head
    count spread, and for ``uniform`` how often it answers exactly as ``moend``."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["setting"], r["budget"], r["variant"]), []).append(r)
    real = {(r["setting"], r["budget"], r["index"]): r.get("generated") for r in records if r["variant"] == "moend"}
    rows = []
    for (setting, budget, variant), rs in sorted(groups.items(), key=lambda kv: _order(kv[0])):
        ok = [r for r in rs if r.get("score") is not None]
        if not ok:
            rows.append(dict(setting=setting, budget=budget, variant=variant, n=0,
                             infeasible=rs[0].get("infeasible")))
            continue
        acc = summarize_scores([r["score"] for r in ok])
        row = dict(setting=setting, budget=budget, variant=variant, n=len(ok), accuracy=100 * acc.mean,
                   low=100 * acc.low, high=100 * acc.high, mb=sum(r["bytes"] for r in ok) / len(ok) / 1e6,
                   ratio16=sum(r["ratio16"] for r in ok) / len(ok))
        if variant != "moend":
            row["head_spread_mean"] = sum(r["head_spread_mean"] for r in ok) / len(ok)
        pairs = [(r["generated"], real.get((setting, budget, r["index"]))) for r in ok]
        pairs = [p for p in pairs if p[1] is not None]
        if variant == "uniform" and pairs:
            row["same_as_moend"] = sum(a == b for a, b in pairs) / len(pairs)
        rows.append(row)
    return rows


def _order(key: tuple[str, str, str]) -> tuple:
    setting, budget, variant = key
    try:
        b = float(budget.rstrip("x"))
    except ValueError:
        b = 0.0
    return setting, b, VARIANTS.index(variant)


def to_markdown(rows: list[dict[str, Any]], settings: HeadBudgetSettings) -> str:
    lines = [f"Per-KV-head budgets (Ada-KV, alpha {settings.alpha:g}) inside the `{settings.method}` plan: "
             f"{settings.task} at {settings.length} tokens, n = {settings.n} per setting. `moend` = the real cache; "
             "`uniform` / `ada` = the simulated cache with one count per head / counts per head; MB = storage (codes, "
             "scales, residual, positions, per-head counts; eviction state left out, the same for all). "
             "Accuracy % [95% interval: Wilson for 0/1 scores, else bootstrap].", "",
             "| setting | budget | variant | n | accuracy | storage MB | x vs 16-bit | head count spread (max/min, "
             "mean over evicting layers) | uniform answers as moend |",
             "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if not r["n"]:
            lines.append(f"| {r['setting']} | {r['budget']} | {r['variant']} | 0 | infeasible | | | | |")
            continue
        spread = f"{r['head_spread_mean']:.2f}" if "head_spread_mean" in r else "-"
        same = f"{100 * r['same_as_moend']:.0f}%" if "same_as_moend" in r else "-"
        lines.append(f"| {r['setting']} | {r['budget']} | {r['variant']} | {r['n']} | {r['accuracy']:.1f} "
                     f"[{r['low']:.0f}, {r['high']:.0f}] | {r['mb']:.2f} | {r['ratio16']:.1f} | {spread} | {same} |")
    return "\n".join(lines) + "\n"


def write_report(records: list[dict[str, Any]], settings: HeadBudgetSettings, out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    rows = summarize(records)
    md = to_markdown(rows, settings)
    paths = {"json": out / "heads.json", "markdown": out / "heads.md"}
    atomic_write_text(paths["json"], json.dumps({"settings": {**asdict(settings),
                                                              "settings": [str(s) for s in settings.settings]},
                                                 "rows": rows}, indent=1))
    atomic_write_text(paths["markdown"], md)
    return paths
