"""The report of a proxy validation (:func:`moend_fx.eval.proxy.validate_proxy`): Markdown and JSON."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from moend_fx.common.io import atomic_write_text


def _fmt(x: float, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{digits}f}"


def markdown_report(result: dict[str, Any]) -> str:
    s = result["settings"]
    c = result["correlation"]
    lines = [
        f"# Proxy validation: predicted loss ({result.get('predictor', 'sum of S')}) vs end-to-end KL",
        "",
        f"Held-out: {s['sequences']} sequences x {s['tokens']} context tokens + {s['continuation']} "
        f"teacher-forced continuation tokens (split `heldout`, seed {s['seed']}"
        + (f"; the last {s['tail']} a retrieval tail" if s.get("tail") else "") + "); "
        f"{s['random_plans']} random plans + `{s['solver']}` plans at budgets {', '.join(s['budgets'])} "
        "(ratios vs a 16-bit cache).",
        "",
        "| plans | n | Pearson | Spearman |",
        "| --- | --- | --- | --- |",
    ]
    for k in ("all", "solver", "random"):
        lines.append(f"| {k} | {c[k]['n']} | {_fmt(c[k]['pearson'])} | {_fmt(c[k]['spearman'])} |")
    lines.append(f"| paper (DeepSeek-R1-Distill-Qwen-7B) | - | {c['paper']['pearson']} | "
                 f"{c['paper']['spearman']} |")
    gained = any(r.get("loss") is not None for r in result["spread"])
    lines += ["", "## Per-layer spread (max / min over layers of S)", ""]
    if gained:
        lines += ["The last column is the spread of the predicted loss gain * S^2 (what a layer's error costs end to "
                  "end), the comparable figure to the paper's sensitivity spread.", ""]
    head = "| column | ours | paper | min S (layer) | max S (layer) |" + (" ours, gain x S^2 |" if gained else "")
    lines += [head, "| --- " * (6 if gained else 5) + "|"]
    for r in result["spread"]:
        row = (f"| {r['name']} | {_fmt(r['ours'], 1)}x | {r['paper']}x | {_fmt(r['min'], 4)} "
               f"({r['argmin_layer']}) | {_fmt(r['max'], 4)} ({r['argmax_layer']}) |")
        lines.append(row + (f" {_fmt(r.get('loss'), 0)}x |" if gained else ""))
    lines += ["", "## Plans", "", "| plan | kind | x vs 16-bit | predicted | measured KL |",
              "| --- | --- | --- | --- | --- |"]
    for p in sorted(result["plans"], key=lambda p: p["predicted"]):
        lines.append(f"| {p['name']} | {p['kind']} | {p['ratio_vs_16bit']:.2f} | {p['predicted']:.4f} | "
                     f"{p['measured_kl']:.5f} |")
    lines += ["", f"Wall time: {result['wall_time_s']:.0f} s.", ""]
    return "\n".join(lines)


def write_report(result: dict[str, Any], out_dir: str | os.PathLike) -> tuple[Path, Path]:
    """``proxy.json`` and ``proxy.md`` in ``out_dir`` (atomic writes)."""
    out = Path(out_dir)
    j = atomic_write_text(out / "proxy.json", json.dumps(result, indent=2, default=_json_default) + "\n")
    m = atomic_write_text(out / "proxy.md", markdown_report(result))
    return j, m


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")
