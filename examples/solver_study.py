"""Greedy vs exact vs Optuna (and the uniform baselines) across budgets, with a plot.

    python examples/solver_study.py                      # synthetic 30-layer paper-shaped table
    python examples/solver_study.py --table smollm2.table --budgets 4x,8x,14x --trials 200,2000

Writes compare.json, compare.md and compare.png into --out (default: solver_study/), plus bench.json with
the greedy / exact timing figures.
"""

from __future__ import annotations

import argparse
import json
import sys

from moend_fx.calibration.tables import load_table, table_context_length
from moend_fx.common.io import atomic_write_text
from moend_fx.solvers.compare import bench_solvers, compare_solvers, markdown_table, write_comparison


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", default="synthetic:30:0", help="table file or synthetic:LAYERS[:SEED]")
    ap.add_argument("--budgets", default="2x,4x,8x,14x,20x")
    ap.add_argument("--trials", default="200", help="comma-separated optuna trial counts")
    ap.add_argument("--context-length", type=int, default=None)
    ap.add_argument("--out", default="solver_study")
    args = ap.parse_args(argv)

    table = load_table(args.table)
    ctx = table_context_length(table, args.context_length or None)
    budgets = [b for b in args.budgets.split(",") if b]
    trials = [int(n) for n in args.trials.split(",") if n]
    result = compare_solvers(table, budgets, context_length=ctx, trials=trials,
                             log=lambda s: print(s, file=sys.stderr))
    paths = write_comparison(result, args.out)
    bench = bench_solvers(table, budgets, context_length=ctx, repeats=50)
    atomic_write_text(f"{args.out}/bench.json", json.dumps(bench, indent=2) + "\n")
    print(markdown_table(result))
    for b, fig in bench["budgets"].items():
        print(f"{b:>6}: greedy median {fig['greedy_median_ms']:.2f} ms, exact median {fig['exact_median_ms']:.2f} ms,"
              f" greedy gap {fig['greedy_gap_pct']:.3f}%")
    print("wrote", ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
