"""``moend eval``: run the long-context evaluation harness and write JSON + Markdown + PNG results.

    moend eval --model smollm2-135m --tasks passkey,niah_multikey --lengths 2048,4096 --n 30 \\
        --budgets 4x,8x,14x --methods full,1d,2d_uniform,2d,pyramid,2d_hetero,2d_hetero_exact \\
        --settings query_aware,query_agnostic --table TABLE.safetensors --out results/run1

Records are saved after every example (``records.jsonl``), so an interrupted run resumes where it stopped
(``--no-resume`` starts over). See ``docs/evaluation.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from moend_fx.calibration.tables import SETTING_TABLES_HINT, setting_tables
from moend_fx.cli.args import csv_list
from moend_fx.common.defaults import DEFAULT_MODEL
from moend_fx.common.errors import MoendError
from moend_fx.common.options import BudgetMode, ReEviction


def _csv(text: str) -> tuple[str, ...]:
    return tuple(csv_list(text))


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in csv_list(text))
    except ValueError:
        raise MoendError(f"--lengths {text!r} must be comma-separated integers (e.g. 2048,4096)") from None


_ints.__name__ = "comma-separated integers"  # argparse names the type in its error message


def register(subparsers: Any) -> None:
    from moend_fx.eval.config import EvalConfig
    from moend_fx.eval.methods import DEFAULT_METHODS, METHODS
    from moend_fx.eval.tasks.registry import SETTINGS, TASKS

    cfg = EvalConfig()  # the defaults are the library's own

    p = subparsers.add_parser(
        "eval", help="long-context accuracy of compression methods at matched measured memory",
        description="Prefill each example once at full precision, compress a copy per method and budget, "
                    "decode greedily, score by string match; write results.{json,md,png}.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="embedded model name or HF folder (default %(default)s)")
    p.add_argument("--table", default=None,
                   help="sensitivity table (.safetensors) for every setting, or query_aware=PATH,query_agnostic=PATH "
                        f"(a setting not named keeps its default); default {SETTING_TABLES_HINT}")
    p.add_argument("--tasks", type=_csv, default=cfg.tasks, help=f"comma list of {', '.join(TASKS)}")
    p.add_argument("--lengths", type=_ints, default=cfg.lengths,
                   help=f"prompt lengths in tokens (default {','.join(map(str, cfg.lengths))})")
    p.add_argument("--n", type=int, default=cfg.n, help="examples per task and length (default %(default)s)")
    p.add_argument("--budgets", type=_csv, default=cfg.budgets,
                   help=f"ratios of the 16-bit cache ('14x') or sizes ('3.3MB'); default {','.join(cfg.budgets)}")
    p.add_argument("--methods", type=_csv, default=DEFAULT_METHODS, help=f"comma list of {', '.join(METHODS)}")
    p.add_argument("--settings", type=_csv, default=SETTINGS, help=f"comma list of {', '.join(SETTINGS)}")
    p.add_argument("--scorer", default=None,
                   help="override the plan's eviction scorer for every MoENDCache method (trig, snapkv, h2o, ...)")
    p.add_argument("--window-stats", action="store_true",
                   help=f"trig: estimate query statistics from the last {cfg.window} queries instead of the table's")
    p.add_argument("--continuation", type=int, default=0, metavar="N",
                   help="also measure teacher-forced continuation KL / loss on N held-out sequences per length")
    p.add_argument("--continuation-tokens", type=int, default=128, help="tokens fed after the context (default 128)")
    p.add_argument("--continuation-only", action="store_true",
                   help="run only the continuation KL (needs --continuation N), not the tasks")
    p.add_argument("--reevict", default=str(cfg.reevict), choices=[str(r) for r in ReEviction],
                   help="what a MoENDCache decode-time re-eviction drops from a packed layer: whole packed groups "
                        "(default; kept codes never re-quantized) or single tokens (survivors re-quantized)")
    p.add_argument("--budget-mode", default=str(cfg.budget_mode), choices=[str(b) for b in BudgetMode],
                   help="MoENDCache's: capacity (default: no layer ever holds more than the plan's bytes) or ratio "
                        "(keep_ratio of the tokens seen, re-evicted every 128 decode steps, growing in between)")
    p.add_argument("--seed", type=int, default=cfg.seed)
    p.add_argument("--max-new-tokens", type=int, default=cfg.max_new_tokens)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", required=True, help="output folder (results.json, results.md, accuracy_vs_bytes.png)")
    p.add_argument("--no-resume", action="store_true", help="ignore records.jsonl already in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from moend_fx.common.options import Setting
    from moend_fx.eval.config import EvalConfig
    from moend_fx.eval.report import write_report
    from moend_fx.eval.runner import Runner
    from moend_fx.models import load_model

    if args.continuation_only and args.continuation <= 0:
        raise MoendError("--continuation-only needs --continuation N (N held-out sequences per length, N >= 1)")
    cfg = EvalConfig(tasks=args.tasks, lengths=args.lengths, n=args.n, budgets=args.budgets, methods=args.methods,
                     settings=args.settings, seed=args.seed, max_new_tokens=args.max_new_tokens,
                     scorer=args.scorer, calibrated_stats=not args.window_stats, reevict=args.reevict,
                     budget_mode=args.budget_mode)
    if args.threads:
        torch.set_num_threads(args.threads)
    tables, paths, warnings = setting_tables(args.model, cfg.settings, args.table)
    for why in warnings:
        print(f"moend eval: warning: {why}", file=sys.stderr)
    model, tokenizer = load_model(args.model)
    runner = Runner(model, tokenizer, tables, cfg, progress=not args.no_progress)
    for name, why in runner.skipped.items():
        print(f"moend eval: skipping {name}: {why}")
    result = None if args.continuation_only else runner.run(args.out, resume=not args.no_resume)
    cont = []
    if args.continuation > 0:
        from moend_fx.calibration.data import token_sequences
        from moend_fx.eval.continuation import continuation_eval

        # held-out text with no question to ask: compressed as the query-agnostic setting is, where it is run
        table = tables.get(Setting.QUERY_AGNOSTIC, tables[cfg.settings[0]])
        for length in cfg.lengths:
            ids, _ = token_sequences(model, tokenizer, args.continuation, length + args.continuation_tokens,
                                     seed=args.seed, split="heldout")
            cont += continuation_eval(model, table, ids, length, methods=runner.methods, budgets=cfg.budgets,
                                      window=cfg.window, progress=not args.no_progress,
                                      records=Path(args.out) / "continuation.jsonl", resume=not args.no_resume)
    meta = dict(result.meta if result else runner.meta(), table_path=str(paths[cfg.settings[0]]),
                model_name=args.model, table_paths={str(s): str(p) for s, p in paths.items()})
    written = write_report(result.records if result else [], args.out, meta=meta,
                           plans=result.plans if result else None, continuation=cont)
    for kind, path in written.items():
        print(f"{kind}: {path}")
    return 0
