"""``moend solve`` and ``moend compare-solvers``.

``--table`` is a table file (loaded with ``SensitivityTable.load``) or ``synthetic:LAYERS[:SEED]`` for a
paper-shaped synthetic table (demos and tests); both are read by :func:`moend_fx.calibration.tables.load_table`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.calibration.tables import load_table, table_context_length
from moend_fx.cli.args import csv_list, int_list, names
from moend_fx.cli.search import add_measured_args
from moend_fx.common.checks import check_int
from moend_fx.common.defaults import CALIBRATION_TOKENS
from moend_fx.common.errors import MoendError
from moend_fx.plan.memory import format_bytes, keep_count, keep_floor, plan_parts
from moend_fx.plan.summary import parts_cells, parts_header, parts_shares, sum_parts
from moend_fx.solvers import SOLVERS, get_solver
from moend_fx.solvers.base import SolveResult, full_cache_figures
from moend_fx.solvers.last_resort import NARROW_K_BITS, NARROW_K_MAX_CONTEXT, NARROW_K_MIN_KEEP
from moend_fx.solvers.optuna_search import Sampler


def _context(args: argparse.Namespace, table: SensitivityTable) -> int:
    if args.context_length is not None:
        check_int("--context-length", args.context_length)
    return table_context_length(table, args.context_length)


def _optuna_options(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {"sampler": args.sampler, "seed": args.seed, "n_jobs": args.n_jobs,
                            "warm_start": args.warm_start}
    if args.storage is not None:
        opts["storage"] = args.storage
    if args.study_name is not None:
        opts["study_name"] = args.study_name
    if args.timeout is not None:
        opts["timeout"] = args.timeout
    return opts


def plan_table_text(res: SolveResult, table: SensitivityTable) -> str:
    """The per-layer plan (layer, config, tokens kept, bytes by part, predicted loss), a totals row, each part's
    share of the total, and the plan's figures. The parts are priced as the solver priced the plan (the table's
    scorer, with its query statistics when it has them), so the totals row is ``res.bytes_used``."""
    plan = res.plan
    ctx, floor = plan.context_length, keep_floor(plan)
    calibrated = table.has_stats()
    rows = plan_parts(plan, calibrated=calibrated)
    lines = [f"{'layer':>5} {'config':<16} {'kept':>6} {parts_header()} {'pred. loss':>10}"]
    for l, (c, parts) in enumerate(zip(plan.layers, rows)):
        lines.append(f"{l:>5} {c.name:<16} {keep_count(ctx, c.keep_ratio, floor):>6} {parts_cells(parts)} "
                     f"{table.loss[l, res.indices[l]]:>10.5f}")
    totals = sum_parts(rows)
    lines += [f"{'total':<5} {'':<16} {'':>6} {parts_cells(totals)} {res.predicted_loss:>10.5f}",
              f"{'share':<5} {'':<16} {'':>6} {parts_shares(totals)}"]
    full = full_cache_figures(table, ctx)
    dtype = table.fingerprint.dtype
    stats = "with" if calibrated else "without"
    lines += [
        f"total: {res.bytes_used} bytes ({format_bytes(res.bytes_used)}), predicted loss {res.predicted_loss:.5f}",
        f"budget: {res.budget}",
        f"vs full cache: {full['full_16bit'] / res.bytes_used:.2f}x smaller than 16-bit "
        f"({format_bytes(full['full_16bit'])}), {full['full_model_dtype'] / res.bytes_used:.2f}x smaller than "
        f"the model's {dtype} ({format_bytes(full['full_model_dtype'])})",
        f"bytes at {ctx} tokens, batch 1; scorer state: {plan.scorer} {stats} calibrated query statistics",
        f"solver: {res.solver}, {res.wall_time_s * 1e3:.2f} ms, {res.iterations} iterations"
        + ("" if "optimal" not in res.info else f", optimal: {res.info['optimal']}"),
    ]
    if res.info.get("last_resort_layers"):
        lines.append(f"last resort: {res.info['last_resort_layers']} layer(s) hold keys of <= {NARROW_K_BITS} bits "
                     "below the solver's narrow_k_min_keep (no plan without them fits the budget)")
    return "\n".join(lines)


def cmd_solve(args: argparse.Namespace) -> int:
    table = load_table(args.table)
    ctx = _context(args, table)
    opts = _optuna_options(args) | {"n_trials": args.trials} if args.solver == "optuna" else {}
    opts["narrow_k_min_keep"] = args.narrow_k_min_keep
    opts["narrow_k_max_context"] = args.narrow_k_max_context
    res = get_solver(args.solver, **opts).solve(table, args.budget, context_length=ctx)
    if args.out:
        res.plan.save(args.out)
    print(plan_table_text(res, table))
    if args.out:
        print(f"plan written to {args.out}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from moend_fx.solvers.compare import compare_solvers, markdown_table, write_comparison

    if args.search_trials and args.table.startswith("synthetic:"):
        raise MoendError("--measured-trials needs a calibrated table file for --model (a synthetic table has no "
                         "model to measure on)")
    table = load_table(args.table)
    ctx = _context(args, table)
    budgets = csv_list(args.budgets)
    if not budgets:
        raise MoendError(f"--budgets={args.budgets!r} is empty; give e.g. '4x,8x,14x'")
    trials = list(int_list(args.trials, "--trials", example="200,2000")) if args.trials else []
    result = compare_solvers(table, budgets, context_length=ctx, trials=trials,
                             optuna_options=_optuna_options(args),
                             log=lambda s: print(s, file=sys.stderr))
    paths = write_comparison(result, args.out)
    print(markdown_table(result))
    if args.search_trials:
        paths.update(_measured(args, budgets))
    print(json.dumps({k: str(v) for k, v in paths.items()}))
    return 0


def _measured(args: argparse.Namespace, budgets: list[str]) -> dict[str, Any]:
    """``--measured-trials N``: greedy, exact and the plan a measured search finds at each budget, re-measured
    on held-out sequences; written as measured.json / .md / .png beside the comparison."""
    from moend_fx.cli.search import run_measured
    from moend_fx.search import report

    result = run_measured(args, budgets, args.out)
    print(report.markdown(result["budgets"], result["text"]), end="")
    paths = report.write(result["budgets"], result["text"], result["points"], args.out, stem="measured")
    return {f"measured_{k}": v for k, v in paths.items()}


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--table", required=True, help="sensitivity table file, or synthetic:LAYERS[:SEED]")
    p.add_argument("--context-length", type=int, default=None,
                   help=f"tokens the plan is solved for (default: the table's, else {CALIBRATION_TOKENS})")
    p.add_argument("--storage", default=None,
                   help="optuna storage: RDB URL (sqlite:///s.db, postgresql://...), journal file path, :memory:")
    p.add_argument("--study-name", default=None, help="optuna study name (share it to search one study)")
    p.add_argument("--sampler", default=str(Sampler.TPE), choices=names(Sampler))
    p.add_argument("--seed", type=int, default=0, help="optuna sampler seed (give each worker its own)")
    p.add_argument("--n-jobs", type=int, default=1, help="optuna threads in this process")
    p.add_argument("--timeout", type=float, default=None, help="optuna time limit in seconds")
    p.add_argument("--warm-start", action="store_true", help="optuna: enqueue the greedy plan first")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("solve", help="solve a routing plan for a memory budget",
                              description="Pick one (keep, K bits, V bits) per layer under a KV-memory budget.")
    _add_common(p)
    p.add_argument("--budget", required=True, help="bytes, a size ('136MB') or a ratio of the 16-bit cache ('14x')")
    p.add_argument("--solver", default="greedy", choices=list(SOLVERS))
    p.add_argument("--out", default=None, help="write the plan JSON here")
    p.add_argument("--trials", type=int, default=200, help="optuna trials")
    p.add_argument("--narrow-k-min-keep", type=float, default=NARROW_K_MIN_KEEP,
                   help=f"keys of <= {NARROW_K_BITS} bits on layers keeping fewer than this share of tokens are a "
                        f"last resort, used only where nothing else fits (default {NARROW_K_MIN_KEEP}; 0: no rule)")
    p.add_argument("--narrow-k-max-context", type=int, default=NARROW_K_MAX_CONTEXT,
                   help="the last-resort rule covers plans for contexts of at most this many tokens (default "
                        f"{NARROW_K_MAX_CONTEXT}; 0: every length)")
    p.set_defaults(func=cmd_solve)

    c = subparsers.add_parser("compare-solvers", help="run every solver on one table and several budgets",
                              description="Predicted loss, gap to the exact optimum, bytes and time per solver.")
    _add_common(c)
    c.add_argument("--budgets", default="4x,8x,14x", help="comma-separated budgets (default 4x,8x,14x)")
    c.add_argument("--trials", default="200,2000", help="comma-separated optuna trial counts ('' for none)")
    c.add_argument("--out", required=True, help="output folder for compare.json / .md / .png")
    add_measured_args(c, trials_flag="--measured-trials", trials_default=0)
    c.set_defaults(func=cmd_compare)
