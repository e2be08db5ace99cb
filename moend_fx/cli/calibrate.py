"""``moend calibrate``, ``moend show-table`` and ``moend validate-proxy``."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.calibration.tables import DEFAULT_TABLE_HINT, default_table_path, table_context_length
from moend_fx.cli.args import csv_list, names, positive_int
from moend_fx.common.defaults import DEFAULT_MODEL
from moend_fx.common.options import ScorerName, SensitivityMeasure, Setting
from moend_fx.plan.config import LayerConfig
from moend_fx.plan.memory import DEFAULT_KEEP_FLOOR, full_cache_bytes, keep_count, plan_layer_parts
from moend_fx.plan.summary import parts_cells, parts_header


def cmd_calibrate(args: argparse.Namespace) -> int:
    import torch

    from moend_fx.calibration.pipeline import calibrate
    from moend_fx.calibration.settings import CalibrationSettings
    from moend_fx.eviction.scorers import default_scorer
    from moend_fx.models import load_model

    scorer = args.scorer or default_scorer(args.setting)
    # checked before the model loads, so a bad value fails at once with the allowed range
    settings = CalibrationSettings(tokens=args.tokens, num_sequences=args.sequences, scorer=scorer, seed=args.seed,
                                   window=args.window, retrieval_tails=args.retrieval_tails,
                                   gain_probe=None if args.no_gains else args.gain_probe, measure=args.measure)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    t0 = time.perf_counter()
    c0 = time.process_time()
    table = calibrate(model, tok, settings=settings, progress=not args.quiet)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out = Path(args.out) if args.out else default_table_path(args.model, args.tokens, scorer=scorer)
    table.save(out)
    print(f"calibrated {table.num_layers} layers x {len(table.grid)} configs on {args.sequences} x "
          f"{args.tokens} tokens in {wall:.1f} s wall ({cpu:.1f} s CPU, {torch.get_num_threads()} threads)")
    print(f"table: {out}")
    return 0


def table_text(table: SensitivityTable) -> str:
    """Text summary: model, calibration, S per keep ratio (mean over layers), spread, the worst layers."""
    from moend_fx.eval.proxy import spread_rows

    fp, cal = table.fingerprint, table.calibration
    lines = [
        f"model: {fp.architecture} ({fp.num_layers} layers, {fp.num_heads} heads, {fp.num_kv_heads} KV heads, "
        f"head_dim {fp.head_dim}, {fp.dtype})",
        f"grid: {table.grid.describe()} = {len(table.grid)} configs; group size {table.group_size}",
        "calibration: " + ", ".join(f"{k}={cal[k]}" for k in ("tokens", "num_sequences", "seed", "scorer",
                                                               "setting", "window") if k in cal),
        f"S range: {table.S.min():.4g} .. {table.S.max():.4g}",
        ("gains: none (predicted loss = sum of S)" if table.gain is None else
         f"gains (probe {(cal.get('gains') or {}).get('probe')}): {table.gain.min():.3g} .. {table.gain.max():.3g} "
         f"({table.gain.max() / table.gain.min():.0f}x; predicted loss = sum of gain * S^2, nats per token)"),
        "",
        "mean S over layers (rows: keep ratio; columns: K/V bits):",
    ]
    g = table.grid
    heads = [f"K{kb}/V{vb}" for kb in g.k_bits for vb in g.v_bits]
    lines.append("keep   " + " ".join(f"{h:>9}" for h in heads))
    for keep in g.keep_ratios:
        vals = [table.column(LayerConfig(keep, kb, vb)).mean() for kb in g.k_bits for vb in g.v_bits]
        lines.append(f"{keep:<6g} " + " ".join(f"{v:9.4f}" for v in vals))
    rows = spread_rows(table)
    if rows:
        lines += ["", "per-layer spread (max/min over layers):"]
        for r in rows:
            ours = "inf" if math.isinf(r["ours"]) else f"{r['ours']:.1f}x"
            lines.append(f"  {r['name']:<32} ours {ours:>9}  paper {r['paper']}x  "
                         f"(most sensitive layer {r['argmax_layer']}, least {r['argmin_layer']})")
    return "\n".join(lines)


def table_parts(table: SensitivityTable, context_length: int) -> dict[LayerConfig, dict[str, int]]:
    """Bytes by part of one layer for each config of the table's grid at ``context_length`` tokens, priced as
    :meth:`SensitivityTable.bytes_matrix` prices them (the table's scorer, with its query statistics when it has
    them). Every layer has the same shape, so one layer's parts stand for every layer's."""
    scorer = str(table.calibration.get("scorer", ScorerName.TRIG))
    return {c: plan_layer_parts(c, context_length, table.fingerprint, group_size=table.group_size, scorer=scorer,
                                calibrated=table.has_stats())
            for c in table.grid.configs}


def table_bytes_text(table: SensitivityTable, context_length: int) -> str:
    """:func:`table_parts` as text, one row per config: tokens kept, bytes by part, total and ``vs 16-bit`` (the
    layer's 16-bit cache of ``context_length`` tokens over its bytes)."""
    fp = table.fingerprint
    full16 = full_cache_bytes(fp, context_length) / fp.num_layers
    stats = "with" if table.has_stats() else "without"
    lines = [f"bytes of one layer by part at {context_length} tokens, batch 1 (the same on every layer)",
             f"scorer state: {table.calibration.get('scorer', ScorerName.TRIG)} {stats} calibrated query statistics",
             f"{'config':<16} {'kept':>6} {parts_header()} {'vs 16-bit':>9}"]
    for c, parts in table_parts(table, context_length).items():
        kept = keep_count(context_length, c.keep_ratio, DEFAULT_KEEP_FLOOR)
        lines.append(f"{c.name:<16} {kept:>6} {parts_cells(parts)} {full16 / sum(parts.values()):>8.2f}x")
    return "\n".join(lines)


def heatmap_png(table: SensitivityTable, path: str | Path) -> Path:
    """Heatmap of log10 S: layers (rows) x configs (columns), written atomically."""

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moend_fx.common.io import atomic_save_figure

    S = table.S
    floor = S[S > 0].min() if (S > 0).any() else 1e-12
    data = np.log10(np.maximum(S, floor))
    fig, ax = plt.subplots(figsize=(max(8, 0.22 * S.shape[1] + 2), max(4, 0.22 * S.shape[0] + 1.5)))
    im = ax.imshow(data, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xticks(range(S.shape[1]))
    ax.set_xticklabels([f"{c.keep_ratio:g}/{c.k_bits}/{c.v_bits}" for c in table.grid.configs], rotation=90,
                       fontsize=6)
    ax.set_ylabel("layer")
    ax.set_xlabel("config (keep / K bits / V bits)")
    ax.set_title(f"log10 S: {table.fingerprint.architecture}, "
                 f"{table.calibration.get('tokens', '?')} tokens, scorer {table.calibration.get('scorer', '?')}")
    fig.colorbar(im, ax=ax, label="log10 relative L2 error")
    return atomic_save_figure(fig, path)


def cmd_show_table(args: argparse.Namespace) -> int:
    table = SensitivityTable.load(args.table)
    ctx = table_context_length(table)
    print(table_text(table))
    print()
    print(table_bytes_text(table, ctx))
    if args.png:
        print(f"heatmap: {heatmap_png(table, args.png)}")
    if args.json:
        parts = {"context_length": ctx, "configs": {c.name: p for c, p in table_parts(table, ctx).items()}}
        print(json.dumps({**table.summary(), "S": table.S.tolist(), "bytes_by_part": parts}, indent=2))
    return 0


def add_tail_option(parser: Any, proxy: Any) -> None:
    """``--tail`` of the proxy check (``proxy``: the default ProxySettings), shared by validate-proxy and bench."""
    parser.add_argument("--tail", type=int, default=proxy.tail,
                        help="end each held-out sequence with a retrieval tail of this many tokens inside the "
                             f"measured continuation ({proxy.continuation}); default: as the table's calibration "
                             "text ended (64 for the v4 default tables); 0 = plain text")


def cmd_validate_proxy(args: argparse.Namespace) -> int:
    import torch

    from moend_fx.eval.proxy import ProxySettings, markdown_report, validate_proxy, write_report
    from moend_fx.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    table = SensitivityTable.load(args.table)
    budgets = tuple(csv_list(args.budgets))
    settings = ProxySettings(sequences=args.sequences, tokens=args.tokens, continuation=args.continuation,
                             seed=args.seed, random_plans=args.plans, budgets=budgets, solver=args.solver,
                             plan_seed=args.plan_seed, window=args.window, tail=args.tail)
    model, tok = load_model(args.model)
    result = validate_proxy(model, tok, table, settings, progress=not args.quiet)
    j, m = write_report(result, args.out)
    print(markdown_report(result))
    print(f"wrote {j} and {m}")
    return 0


def register(subparsers: Any) -> None:
    # The defaults are the library's own (one home): the settings classes' field defaults.
    from moend_fx.calibration.settings import CalibrationSettings
    from moend_fx.eval.proxy import ProxySettings

    cal, proxy = CalibrationSettings(), ProxySettings()
    p = subparsers.add_parser("calibrate", help="measure the per-layer sensitivity table S[layer, config]",
                              description="One prefill per calibration sequence, then every grid config "
                                          "per layer. Writes a safetensors table.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="embedded model name or HF folder")
    p.add_argument("--tokens", type=positive_int, default=cal.tokens, help="tokens per calibration sequence")
    p.add_argument("--sequences", type=positive_int, default=cal.num_sequences,
                   help="calibration sequences (default %(default)s)")
    p.add_argument("--setting", default=str(Setting.QUERY_AGNOSTIC), choices=names(Setting),
                   help="what the table is for: query_aware (prompts that end with their question: scorer "
                        f"{ScorerName.SNAPKV_TRIG}) or query_agnostic (scorer {ScorerName.TRIG}); default %(default)s")
    p.add_argument("--scorer", default=None, choices=names(ScorerName),
                   help="eviction scorer (default: the setting's)")
    p.add_argument("--seed", type=int, default=cal.seed, help="calibration text seed")
    p.add_argument("--window", type=positive_int, default=cal.window,
                   help="last queries whose attention error is measured (default %(default)s)")
    p.add_argument("--retrieval-tails", type=int, default=cal.retrieval_tails, metavar="N",
                   help="end the first N sequences with --window tokens of questions about their earlier records "
                        "(0 to --sequences; default: all)")
    p.add_argument("--gain-probe", default=cal.gain_probe,
                   help="config (keep<ratio>_k<bits>_v<bits>) whose end-to-end KL, one layer at a time, sets the "
                        "per-layer gains: the predicted loss is sum gain * S^2 (default %(default)s; "
                        "docs/calibration.md, 'Gains')")
    p.add_argument("--measure", default=str(cal.measure), choices=names(SensitivityMeasure),
                   help="what S measures: l2 (the attention output's relative L2 error, the paper's) or top1 (the "
                        "share of query rows whose most-attended key changes; sees no V error); default "
                        "%(default)s (docs/calibration.md, 'What S measures')")
    p.add_argument("--no-gains", action="store_true",
                   help="no per-layer gains: the predicted loss is the paper's sum of S (~5x faster)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--out", default=None,
                   help="table file (default $MOEND_CACHE/tables/<model>-<scorer>-<tokens>.safetensors, e.g. "
                        f"{DEFAULT_TABLE_HINT})")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_calibrate)

    s = subparsers.add_parser("show-table", help="summarise a sensitivity table (text, optional heatmap PNG)")
    s.add_argument("table", help="table file (.safetensors)")
    s.add_argument("--png", default=None, help="write a heatmap (layers x configs) here")
    s.add_argument("--json", action="store_true", help="also print the table as JSON")
    s.set_defaults(func=cmd_show_table)

    v = subparsers.add_parser("validate-proxy", help="correlate the table's predicted loss with end-to-end KL",
                              description="Held-out sequences, random and solver plans; Pearson/Spearman and "
                                          "the per-layer spread vs the paper. Writes proxy.json and proxy.md.")
    v.add_argument("--table", required=True, help="table file (.safetensors)")
    v.add_argument("--model", default=DEFAULT_MODEL)
    v.add_argument("--sequences", type=positive_int, default=proxy.sequences)
    v.add_argument("--tokens", type=positive_int, default=proxy.tokens, help="context tokens per held-out sequence")
    v.add_argument("--continuation", type=positive_int, default=proxy.continuation,
                   help="teacher-forced tokens after the context")
    v.add_argument("--plans", type=int, default=proxy.random_plans, help="random plans (solver plans come on top)")
    v.add_argument("--budgets", default=",".join(proxy.budgets), help="comma-separated solver budgets")
    v.add_argument("--solver", default=proxy.solver)
    v.add_argument("--seed", type=int, default=proxy.seed, help="held-out text seed")
    v.add_argument("--plan-seed", type=int, default=proxy.plan_seed,
                   help="random plans' seed (another seed: an independent set of plans)")
    v.add_argument("--window", type=positive_int, default=proxy.window)
    add_tail_option(v, proxy)
    v.add_argument("--threads", type=int, default=0)
    v.add_argument("--out", required=True, help="output folder")
    v.add_argument("--quiet", action="store_true")
    v.set_defaults(func=cmd_validate_proxy)
