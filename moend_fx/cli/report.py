"""``moend report``: pool the records of several ``moend eval`` runs (other seeds, other methods) into one report.

    moend report results/eval-8k results/eval-seed1-8k --out results/pooled-8k
    moend report docs/data/eval-published results/eval-seed1-2k4k --lengths 2048,4096 --out results/pooled-2k4k

Writes results.{json,md,png} as ``moend eval`` does, with each method paired with the full cache on the same
examples. Runs must be on one model and agree on what changes a method's answer (``moend_fx.eval.pool``).

    moend report --published      # (make figures) re-render README.md's and docs/results.md's tables and figures

re-renders every published table and figure from the committed records in docs/data/
(``moend_fx.bench.published_render``).
"""

from __future__ import annotations

import argparse
from typing import Any

from moend_fx.cli.args import csv_list, int_list
from moend_fx.common.errors import MoendError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "report", help="pool moend eval runs (e.g. of other seeds) into one report, paired with the full cache",
        description="Pool the records of moend eval runs (their --out folders or results.json files), one example "
                    "per (task, seed, index), and write results.{json,md,png} with each method paired with the "
                    "full cache on the same examples.",
    )
    p.add_argument("runs", nargs="*", metavar="RUN", help="a 'moend eval --out' folder or its results.json")
    p.add_argument("--published", action="store_true",
                   help="instead: re-render the tables and figures of README.md and docs/results.md from the records "
                        "in docs/data/ (run in the repository root)")
    p.add_argument("--methods", type=csv_list, default=None, help="comma list: pool only these methods' records")
    p.add_argument("--lengths", default=None,
                   help="comma list of target lengths in tokens: pool only these lengths' records (e.g. 2048,4096)")
    p.add_argument("--reference", default="full",
                   help="method every other is paired with (default %(default)s; a budgeted one, e.g. 2d_hetero, "
                        "is paired at each budget)")
    p.add_argument("--out", default=None, help="output folder (results.json, results.md, accuracy_vs_bytes.png)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.published:
        from moend_fx.bench.published_render import render_published

        for path in render_published("."):
            print(f"wrote {path}")
        return 0
    if not args.runs or args.out is None:
        raise MoendError("moend report needs RUN folders and --out (or --published alone)")
    from moend_fx.eval.pool import pool_runs
    from moend_fx.eval.report import write_report

    lengths = None if args.lengths is None else int_list(args.lengths, "--lengths")
    pooled = pool_runs(args.runs, methods=args.methods, lengths=lengths)
    for s in pooled.meta["pooled"]["sources"]:
        print(f"{s['path']}: {s['records']} records, seed {s['seed']}")
    if pooled.meta["pooled"]["duplicates"]:
        print(f"{pooled.meta['pooled']['duplicates']} records repeated with the same result (kept once)")
    if args.reference not in {r["method"] for r in pooled.records}:
        raise MoendError(f"--reference {args.reference}: no pooled record is of that method; they are of "
                         f"{', '.join(sorted({r['method'] for r in pooled.records}))}")
    for kind, path in write_report(pooled.records, args.out, meta=pooled.meta, reference=args.reference).items():
        print(f"{kind}: {path}")
    return 0
