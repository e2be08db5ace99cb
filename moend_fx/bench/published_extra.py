"""Renderers of the published tables whose records are not ``moend eval`` / ``moend bench`` kernel or decode runs:
Gemma 3 270M's first accuracy measurement (per-example JSON lines) and self-speculative decoding
(``moend bench speculative``). Registered in :mod:`moend_fx.bench.published_tables`."""

from __future__ import annotations

import json
from pathlib import Path

from moend_fx.common.errors import MoendError
from moend_fx.eval.stats import wilson_interval


def gemma_table(folder: Path) -> str:
    """Per task: the full hybrid cache and the 14x cache (answers right out of n, Wilson 95%), and the 14x cache's
    most bytes at any step as x of the hybrid 16-bit cache."""
    path = folder / "records.jsonl"
    if not path.is_file():
        raise MoendError(f"published record {path} is missing: a published table is rendered from it")
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    lines = ["| task | n | full hybrid cache | MoE-nD 14x (of the hybrid 16-bit cache) | "
             "14x cache, most bytes at any step |",
             "| --- | ---: | --- | --- | ---: |"]
    for task in dict.fromkeys(r["task"] for r in recs):
        cells = []
        for method in ("full", "moend_14x"):
            scores = [r["score"] for r in recs if r["task"] == task and r["method"] == method]
            low, high = wilson_interval(sum(scores), len(scores))
            cells.append(f"{sum(scores):g}/{len(scores)} [{low:.2f}, {high:.2f}]")
        peak = max(r["max_bytes"] for r in recs if r["task"] == task and r["method"] == "moend_14x")
        full16 = recs[0]["full16_bytes"]
        lines.append(f"| {task} | {len(scores)} | {cells[0]} | {cells[1]} | {peak:,} B ({full16 / peak:.1f}x) |")
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
