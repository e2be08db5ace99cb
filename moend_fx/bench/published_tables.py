"""The tables published in README.md and docs/results.md, each rendered from one committed record folder.

Every published table has a name, a folder ``docs/data/<name>/`` holding the records it is rendered from, and the
command that made those records. In a document a table sits between ``<!-- table:<name> -->`` and
``<!-- /table:<name> -->``; :func:`moend_fx.bench.published_render.render_published` rewrites those blocks from the
records (``make figures``), and tests/bench/test_published.py checks that the committed text is what the records
render to, so no published number can drift from its records.

Renderers read JSON only (no torch, no model): the stored summaries of ``moend eval`` / ``moend report`` results
(``summary``, ``paired``), the decode, prefill, proxy and kernel benchmarks' JSON.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moend_fx.bench.decode_tables import compile_table
from moend_fx.bench.published_extra import gemma_decode_table, gemma_table, speculative_table
from moend_fx.common.errors import MoendError
from moend_fx.eval.report_markdown import headline
from moend_fx.eval.summary import AVG
from moend_fx.plan.memory import format_bytes


@dataclass(frozen=True)
class PublishedTable:
    """One published table: ``name`` is its folder under docs/data and its marker in the documents;
    ``command`` made the records; ``render`` turns the folder into Markdown."""

    name: str
    command: str
    render: Callable[[Path], str]


def _load(path: Path) -> Any:
    if not path.is_file():
        raise MoendError(f"published record {path} is missing: a published table is rendered from it")
    return json.loads(path.read_text())


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _diff(p: dict[str, Any] | None) -> str:
    if p is None:
        return "-"
    return f"{100 * p['diff']:+.1f} [{100 * p['low']:+.1f}, {100 * p['high']:+.1f}]"


def accuracy_table(folder: Path) -> str:
    """MoE-nD (``2d_hetero``) per (setting, length): the full cache, MoE-nD at 14x / 20x paired with the full
    cache on the same examples (difference, 95% stratified bootstrap interval), its peak bytes, and the best
    uniform baseline at 14x (the matched-bytes one included)."""
    doc = _load(folder / "results.json")
    rows, paired = doc["summary"], doc["paired"]
    pair = {(p["setting"], p["target_length"], p["budget"]): p for p in paired if p["method"] == "2d_hetero"}
    heads = {(h["setting"], h["target_length"], h["budget"]): h for h in headline(rows)}
    full = {(r["setting"], r["target_length"]): r for r in rows if r["task"] == AVG and r["method"] == "full"}
    lines = ["| setting | tokens | n | full cache | MoE-nD 14x vs full [95%] | its peak | MoE-nD 20x vs full [95%] | "
             "its peak | best uniform at 14x | MoE-nD 14x vs it |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for (setting, length), f in sorted(full.items()):
        h14, h20 = heads.get((setting, length, "14x")), heads.get((setting, length, "20x"))
        p14, p20 = pair.get((setting, length, "14x")), pair.get((setting, length, "20x"))
        best = "-" if h14 is None else f"`{h14['best_baseline']}` {_pct(h14['best_baseline_mean'])}"
        vs = "-" if h14 is None or h14["vs_best"] is None else f"{100 * h14['vs_best']:+.1f}"
        lines.append(f"| {setting} | {length} | {p14['n'] if p14 else '-'} | {_pct(f['mean'])} | {_diff(p14)} | "
                     f"{_peak(h14)} | {_diff(p20)} | {_peak(h20)} | {best} | {vs} |")
    return "\n".join(lines) + "\n"


def _peak(h: dict[str, Any] | None) -> str:
    """The peak ratio (x of a 16-bit cache); records from before the peak was measured give the ratio after the
    prompt instead, marked so."""
    if h is None:
        return "-"
    if h.get("peak_ratio16") is None:
        return f"{h['ratio16']:.1f}x after the prompt"
    return f"{h['peak_ratio16']:.1f}x"


def accuracy_methods_table(folder: Path) -> str:
    """Every method's task-averaged accuracy and peak bytes (x of a 16-bit cache) per (setting, length), at 14x
    and 20x (the full cache unbudgeted)."""
    doc = _load(folder / "results.json")
    avg = [r for r in doc["summary"] if r["task"] == AVG and r["budget"] in (None, "14x", "20x")]
    cells = sorted({(r["setting"], r["target_length"]) for r in avg})
    order = sorted(avg, key=lambda r: (r["budget"] is not None, r["budget"] or "", r["method"] == "2d_hetero"))
    labels = list(dict.fromkeys((r["method"], r["budget"]) for r in order))
    cell = {(r["setting"], r["target_length"], r["method"], r["budget"]): r for r in avg}
    lines = ["| method @ budget | " + " | ".join(f"{s.replace('query_', 'q-')} {n}" for s, n in cells) + " |",
             "| --- |" + " ---: |" * len(cells)]
    for m, budget in labels:
        vals = []
        for s, n in cells:
            r = cell.get((s, n, m, budget))
            if r is None or r["mean"] is None:
                vals.append("-")
                continue
            peak = f" ({r['peak_ratio16']:.1f}x)" if r.get("peak_ratio16") is not None else ""
            vals.append(f"{_pct(r['mean'])}{peak}")
        lines.append(f"| `{m}`{'' if budget is None else ' @ ' + budget} | " + " | ".join(vals) + " |")
    return "\n".join(lines + ["", _over_budget(doc["records"])]) + "\n"


def _over_budget(records: list[dict[str, Any]]) -> str:
    """One sentence: how many budgeted runs' caches held more than their budget at their peak (every budget)."""
    peaked = [r for r in records if r.get("budget_bytes") and r.get("peak_bytes") is not None]
    over = sum(r["peak_bytes"] > r["budget_bytes"] for r in peaked)
    return (f"Budgeted runs whose cache held more than its budget at its peak (14x and 20x): {over} of "
            f"{len(peaked)} with a recorded peak.")


def decode_table(folder: Path) -> str:
    """Decode on CPU: ms per step at batch 1 by context, tokens/s by batch at the batch context, against the
    full cache eager (``full_eager``) and compiled by inductor (``full_inductor``); then the compile times."""
    result = _load(folder / "decode.json")
    ok = [r for r in result["rows"] if r["status"] == "ok"]
    methods = list(dict.fromkeys(r["method"] for r in ok))
    ctxs = sorted({r["tokens"] for r in ok if r.get("batch", 1) == 1})
    at = {(r["method"], r["tokens"], r.get("batch", 1)): r for r in ok}
    m = result["meta"]
    lines = [f"`{m['model_name']}` ({m['model']['dtype']}), {m['threads']} threads, {m['settings']['budget']} plan, "
             f"median of {m['settings']['steps']} steps; ms per decode step at batch 1 (x = full_eager ms / ms):", "",
             "| method | " + " | ".join(f"{c} tokens" for c in ctxs) + " | cache at " + str(ctxs[-1]) + " |",
             "| --- |" + " ---: |" * (len(ctxs) + 1)]
    for name in methods:
        cells = [f"{at[name, c, 1]['ms_median']:.1f} ({at[name, c, 1]['speedup_vs_baseline']:.2f}x)"
                 if (name, c, 1) in at else "-" for c in ctxs]
        last = at.get((name, ctxs[-1], 1))
        cache = "-" if last is None else f"{format_bytes(last['cache_bytes'])} ({last['cache_ratio_16bit']:.1f}x)"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {cache} |")
    batches = sorted({r.get("batch", 1) for r in ok})
    if len(batches) > 1:
        (bctx,) = set(m["settings"]["batch_lengths"])
        fit = {(f["method"], f["tokens"]): f["largest_batch"] for f in result.get("fit") or []}
        lines += ["", f"Tokens/s over the whole batch at {bctx} tokens (x = against full_eager at that batch); "
                  "largest batch under the memory cap is predicted by the memory model, not measured:", "",
                  "| method | " + " | ".join(f"batch {b}" for b in batches) + " | largest batch under "
                  f"{m['settings']['memory_cap']} |", "| --- |" + " ---: |" * (len(batches) + 1)]
        for name in methods:
            cells = [f"{at[name, bctx, b]['tokens_per_s']:.1f} ({at[name, bctx, b]['speedup_vs_baseline']:.2f}x)"
                     if (name, bctx, b) in at else "-" for b in batches]
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {fit.get((name, bctx), '-')} |")
    return "\n".join(lines + compile_table(result)) + "\n"


def prefill_table(folder: Path) -> str:
    from moend_fx.bench.prefill import markdown_table

    return markdown_table(_load(folder / "prefill.json"))


def kernels_table(folder: Path) -> str:
    """The fused CPU kernel against fp32 SDPA: per (method, tokens, threads), the median over the runs in the
    folder of ms, x vs SDPA and GB/s, with the smallest and largest x."""
    runs = [_load(p) for p in sorted(folder.glob("run*.json"))]
    if not runs:
        raise MoendError(f"{folder} holds no run*.json")
    keys = list(dict.fromkeys((r["method"], r["tokens"], r["threads"]) for r in runs[0]))
    by = {k: [r for run in runs for r in run if (r["method"], r["tokens"], r["threads"]) == k] for k in keys}
    lines = [f"Median of {len(runs)} runs (one call, q 1x9x1x64, 3 KV heads; x vs SDPA = fp32 SDPA ms / ms at the "
             "same thread count, with the range over the runs):", "",
             "| method | tokens | threads | ms | x vs SDPA (range) | GB/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for (method, tokens, threads), rs in by.items():
        if not method.startswith(("cpu_k4v4", "sdpa")) or threads != 2:
            continue  # the published configuration (k4v4, 2 threads); the runs hold every variant
        xs = [r["x_vs_sdpa"] for r in rs]
        lines.append(f"| {method} | {tokens} | {threads} | {statistics.median(r['ms'] for r in rs):.3f} | "
                     f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f}) | "
                     f"{statistics.median(r['gb_per_s'] for r in rs):.1f} |")
    return "\n".join(lines) + "\n"


def triton_table(folder: Path) -> str:
    """The Triton kernel (k4v4) against fp16 SDPA on the GPU the records name, per (batch, tokens)."""
    (path,) = sorted(folder.glob("*.json"))
    rows = _load(path)
    at = {(r["method"], r["batch"], r["tokens"]): r for r in rows}
    lines = [f"{rows[0]['device']}, one decode attention call, 3 KV heads, fp16 queries; ms per call (x = SDPA ms / "
             "ms, > 1 is faster):", "", "| batch | tokens | fp16 SDPA | Triton k4v4 | x |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for (method, batch, tokens), r in at.items():
        if method != "triton_k4v4":
            continue
        s = at[("sdpa_fp16", batch, tokens)]
        lines.append(f"| {batch} | {tokens} | {s['ms']:.3f} ms | {r['ms']:.3f} ms | {s['ms'] / r['ms']:.2f}x |")
    return "\n".join(lines) + "\n"


def static_table(folder: Path) -> str:
    """The Triton kernel's static SASS figures on sm_90, before (the kernel of 33b31d1) and after its rebuild, per
    shipped variant: registers, spilled bytes, main-loop warp-instructions per HBM byte, I2F, the dot."""
    before = {(r["variant"], r["arch"]): r for r in _load(folder / "before.json")}
    lines = ["Compiled for sm_90 on a CPU with Triton's bundled ptxas (no GPU involved); per variant, before -> after:",
             "", "| variant | registers | spilled B | warp-instr / HBM byte | I2F in loop | dot in loop |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for a in _load(folder / "after.json"):
        b = before.get((a["variant"], a["arch"]))
        if a["arch"] != 90 or b is None:
            continue
        dot = " -> ".join(", ".join(r["loop_dot"]) for r in (b, a))
        lines.append(f"| {a['variant']} | {b['registers']} -> {a['registers']} | {b['local_bytes']} -> "
                     f"{a['local_bytes']} | {b['instr_per_byte']:.3f} -> {a['instr_per_byte']:.3f} | "
                     f"{b['loop_i2f']} -> {a['loop_i2f']} | {dot} |")
    return "\n".join(lines) + "\n"


PROXY_RUNS = (("retrieval-tail", "default query-agnostic table, held-out text ending with a retrieval tail"),
              ("plain-text", "default query-agnostic table, plain held-out text (`--tail 0`)"),
              ("query-aware", "default query-aware table (`snapkv_trig`), held-out text with the tail"))


def proxy_table(folder: Path) -> str:
    """Predicted loss (sum of gain * S^2) against measured KL: rank and linear correlation over 32 plans."""
    lines = ["| table, held-out text | plans | Pearson | Spearman | Spearman, solver plans | Spearman, random plans |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for sub, what in PROXY_RUNS:
        c = _load(folder / sub / "proxy.json")["correlation"]
        lines.append(f"| {what} | {c['all']['n']} | {c['all']['pearson']:.3f} | {c['all']['spearman']:.3f} | "
                     f"{c['solver']['spearman']:.3f} | {c['random']['spearman']:.3f} |")
    paper = c["paper"]  # the paper's figures, stored with each run for comparison
    lines.append(f"| the paper's, for comparison | - | {paper['pearson']:.3f} | {paper['spearman']:.3f} | - | - |")
    return "\n".join(lines) + "\n"


EVAL_CMD = "moend eval --out docs/data/... (one run per seed), pooled with moend report RUN... --out docs/data/"
TABLES: tuple[PublishedTable, ...] = (
    PublishedTable("accuracy-2k4k", EVAL_CMD + "accuracy-2k4k --lengths 2048,4096", accuracy_table),
    PublishedTable("accuracy-8k", EVAL_CMD + "accuracy-8k --lengths 7900", accuracy_table),
    PublishedTable("decode-cpu", "moend bench decode --steps 8 --warmup 2 --batches 1,4,8,16 --batch-lengths 4096 "
                   "--memory-cap 8GB --compile-times --threads 2 --out docs/data/decode-cpu --doc ''", decode_table),
    PublishedTable("prefill-16k", "moend bench prefill --model qwen2.5-0.5b --length 16384 --threads 1 "
                   "--out docs/data/prefill-16k",
                   prefill_table),
    PublishedTable("kernels-cpu", "moend bench kernels --lengths 8192,32768,131072 --runs 30 --doc '' --out "
                   "docs/data/kernels-cpu/runN (five times)", kernels_table),
    PublishedTable("kernels-gpu", "moend bench triton (on a CUDA GPU; CI has none)", triton_table),
    PublishedTable("kernels-static", "moend bench kernels --static --out DIR (before: the kernel of 33b31d1)",
                   static_table),
    PublishedTable("gemma3", "moend eval --model gemma3-270m --tasks passkey,niah_single --settings query_aware "
                   "--budgets 8x,14x,20x --methods full,2d_uniform,2d_uniform_matched,pyramid,2d_hetero --threads 1 "
                   "--out results/gemma3-eval-L (L: --lengths 4096 --n 20; 8192 --n 10; 16384 --n 10), pooled with "
                   "moend report RUN... --out docs/data/gemma3", gemma_table),
    PublishedTable("speculative", "moend bench speculative --contexts N --batches 1,8 --lock /tmp/moend_bench.lock "
                   "--name speculative-N --table <the snapkv_trig table> --out docs/data/speculative",
                   speculative_table),
    PublishedTable("proxy", "moend bench proxy --threads 2 --doc '' --out docs/data/proxy/SUB "
                   "(SUB plain-text: --tail 0; "
                   "query-aware: --table the snapkv_trig table)", proxy_table),
)
# Views of a folder that another table already names (a second table over the same records).
VIEWS: dict[str, tuple[str, Callable[[Path], str]]] = {
    "accuracy-2k4k-methods": ("accuracy-2k4k", accuracy_methods_table),
    "accuracy-8k-methods": ("accuracy-8k", accuracy_methods_table),
    "gemma3-decode": ("gemma3", gemma_decode_table),
}


def table_names() -> tuple[str, ...]:
    return tuple(t.name for t in TABLES) + tuple(VIEWS)


def render_table(name: str, data_dir: Path) -> str:
    """Markdown of the published table ``name`` from its records under ``data_dir`` (docs/data)."""
    for t in TABLES:
        if t.name == name:
            return t.render(data_dir / name)
    if name in VIEWS:
        folder, fn = VIEWS[name]
        return fn(data_dir / folder)
    raise MoendError(f"published table {name!r} is unknown; allowed: {', '.join(table_names())}")
