"""Renderers of published tables kept apart from :mod:`moend_fx.bench.published_tables`: Gemma 3 270M's accuracy (a
``moend report`` of its ``moend eval`` runs, one table over three lengths) and decode speed, and self-speculative
decoding (``moend bench speculative``). Registered in :mod:`moend_fx.bench.published_tables`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moend_fx.common.errors import MoendError
from moend_fx.eval.stats import wilson_interval
from moend_fx.eval.summary import AVG

_GEMMA_ORDER = ("full", "2d_uniform", "2d_uniform_matched", "1d", "2d", "pyramid", "2d_hetero")


def _load_json(path: Path) -> Any:
    if not path.is_file():
        raise MoendError(f"published record {path} is missing: a published table is rendered from it")
    return json.loads(path.read_text())


def gemma_table(folder: Path) -> str:
    """Gemma 3 270M (``moend report`` of its ``moend eval`` runs, ``folder/results.json``): per method @ budget and
    length, the accuracy % over both tasks' examples with its Wilson 95% interval (the tasks have the same n at a
    length, so this is the task average) and, in brackets, the hybrid 16-bit cache's bytes (sliding layers keep their
    window) over the cache's most bytes while it answered, the mean over the examples; then the n, the hybrid 16-bit
    cache's bytes and how many budgeted runs held more than their budget."""
    doc = _load_json(folder / "results.json")
    per_task = [r for r in doc["summary"] if r["task"] != AVG]
    lengths = sorted({r["target_length"] for r in per_task})
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for r in per_task:
        cells.setdefault((r["target_length"], r["method"], r["budget"]), []).append(r)
    labels = sorted({(r["method"], r["budget"]) for r in per_task},
                    key=lambda mb: (mb[1] is not None, float((mb[1] or "0x").rstrip("x")),
                                    _GEMMA_ORDER.index(mb[0]) if mb[0] in _GEMMA_ORDER else len(_GEMMA_ORDER)))
    lines = ["| method @ budget | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
             "| --- |" + " ---: |" * len(lengths)]
    for m, budget in labels:
        vals = []
        for n in lengths:
            rs = [r for r in cells.get((n, m, budget), []) if r["mean"] is not None]
            if not rs:
                vals.append("infeasible" if cells.get((n, m, budget)) else "-")
                continue
            right, total = round(sum(r["mean"] * r["n"] for r in rs)), sum(r["n"] for r in rs)
            low, high = wilson_interval(right, total)
            peak = None if any(r.get("peak_ratio16") is None for r in rs) else \
                sum(r["peak_ratio16"] * r["n"] for r in rs) / total
            vals.append(f"{100 * right / total:.1f} [{100 * low:.0f}, {100 * high:.0f}]"
                        + ("" if peak is None else f" ({peak:.1f}x)"))
        lines.append(f"| `{m}`{'' if budget is None else ' @ ' + budget} | " + " | ".join(vals) + " |")
    recs = doc["records"]
    n: dict[int, dict[str, set]] = {}
    for r in recs:
        if r["method"] == "full":
            n.setdefault(r["target_length"], {}).setdefault(r["task"], set()).add((r["seed"], r["index"]))
    full16 = {t: max(r["full16_bytes"] for r in recs if r["target_length"] == t) for t in lengths}
    peaked = [r for r in recs if r.get("budget_bytes") and r.get("peak_bytes") is not None]
    over = sum(r["peak_bytes"] > r["budget_bytes"] for r in peaked)
    lines += ["", "n (examples per task): " + "; ".join(
        f"{t}: " + ", ".join(f"{task} {len(ids)}" for task, ids in sorted(n.get(t, {}).items())) for t in lengths)
        + ". Hybrid 16-bit cache (the ratio base; the largest prompt's): " + "; ".join(
        f"{t}: {full16[t]:,} B" for t in lengths)
        + f". Budgeted runs whose cache held more than its budget at its peak: {over} of {len(peaked)}."]
    return "\n".join(lines) + "\n"


def gemma_decode_table(folder: Path) -> str:
    """Gemma 3 270M decode on CPU (``moend bench decode`` runs, ``folder/decode-*.json``): ms per step at batch 1
    (median), the full hybrid cache's eager step over it, and the cache's measured bytes, per method and context."""
    paths = sorted(folder.glob("decode-*.json"))
    if not paths:
        raise MoendError(f"published records {folder}/decode-*.json are missing: a published table is rendered "
                         "from them")
    rows = [r for p in paths for r in _load_json(p)["rows"] if r.get("status") == "ok" and r.get("batch", 1) == 1]
    ctxs = sorted({r["tokens"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    at = {(r["method"], r["tokens"]): r for r in rows}
    lines = ["| method | " + " | ".join(f"{c} tokens: ms / step | x full_eager | cache" for c in ctxs) + " |",
             "| --- |" + " ---: | ---: | ---: |" * len(ctxs)]
    for m in methods:
        vals = []
        for c in ctxs:
            r, base = at.get((m, c)), at.get(("full_eager", c))
            if r is None:
                vals += ["-", "-", "-"]
                continue
            vals += [f"{r['ms_median']:.1f}", "-" if base is None else f"{base['ms_median'] / r['ms_median']:.2f}",
                     f"{r['cache_bytes'] / 1e6:.2f} MB"]
        lines.append(f"| {m} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


_METHODS = ("full", "moend", "self-spec")


def speculative_table(folder: Path) -> str:
    """Decode tokens/s of the full cache, the compressed cache and self-speculation (draft over the compressed
    cache, verify over the full one), per context and batch, from every ``speculative*.json`` in ``folder`` (one
    per ``moend bench speculative`` run), with the acceptance (the batch's; the rows' own in brackets) and
    whether every row's tokens are the full cache's."""
    paths = sorted(folder.glob("speculative*.json"))
    if not paths:
        raise MoendError(f"published records {folder}/speculative*.json are missing: a published table is rendered "
                         "from them")
    rows = [r for p in paths for r in json.loads(p.read_text())["rows"]]
    rows.sort(key=lambda r: (r["context"], r.get("batch", 1), _METHODS.index(r["method"])))
    lines = ["| context | batch | method | tokens/s | x full cache | acceptance (rows alone) | "
             "same tokens as the full cache |",
             "| ---: | ---: | --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        acc = "" if r.get("acceptance") is None else f"{r['acceptance']:.2f}"
        if r.get("row_acceptance") is not None:
            acc += f" ({r['row_acceptance']:.2f})"
        same = "" if "same_as_full" not in r else (
            "yes" if r["same_as_full"] else f"no (from token {r['first_difference']})")
        lines.append(f"| {r['context']} | {r.get('batch', 1)} | {r['method']} | {r['tokens_per_s']:.2f} | "
                     f"{r['speed_vs_full']:.2f} | {acc} | {same} |")
    return "\n".join(lines) + "\n"
