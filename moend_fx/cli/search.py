"""``moend search``: a worker of an Optuna study that searches plans on measured continuation KL.

Start it N times with the same ``--storage`` and ``--study`` to search one study with N workers (SQLite or a
journal file on one machine, an RDB URL across machines); each stops when the study holds ``--trials``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from moend_fx.calibration.tables import DEFAULT_TABLE_HINT, default_table_path, require_table
from moend_fx.cli.args import csv_list, names, positive_int
from moend_fx.common.defaults import CALIBRATION_TOKENS, DEFAULT_MODEL
from moend_fx.common.errors import MoendError

DEFAULT_OUT = "results/search"


def settings_from_args(args: argparse.Namespace, budget: str) -> Any:
    from moend_fx.search import HeldOutText, SearchSettings

    text = HeldOutText(search=args.sequences, check=args.check, tokens=args.tokens,
                       continuation=args.continuation, seed=args.text_seed)
    sampler = args.sampler or ("nsga2" if args.objectives == "kl_bytes" else "tpe")
    return SearchSettings(budget=budget, trials=args.search_trials, radius=args.radius, space=args.space,
                          objectives=args.objectives, sampler=sampler, seed=args.seed, text=text,
                          lock_timeout=args.lock_timeout)


def default_storage(out: str) -> str:
    return f"sqlite:///{(Path(out) / 'study.db').resolve()}"


def run_measured(args: argparse.Namespace, budgets: list[str], out: str) -> dict[str, Any]:
    """Check the storage (default ``out/study.db``), load the model and table, search every budget; returns the
    search result."""
    import torch

    from moend_fx.models import load_model
    from moend_fx.search.run import search_budgets
    from moend_fx.search.study import check_storage

    if not budgets:
        raise MoendError("no budget given; e.g. --budgets 8x,14x")
    settings = settings_from_args(args, budgets[0])
    storage = args.storage or default_storage(out)
    if storage.startswith("sqlite:///"):
        Path(storage[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    check_storage(storage, settings.lock_timeout)  # before the model loads: a bad storage fails in a second
    if args.threads:
        torch.set_num_threads(args.threads)
    table = require_table(args.table or default_table_path(args.model))
    model, tok = load_model(args.model)
    return search_budgets(model, tok, table, settings, budgets, storage=storage, study=args.study,
                          progress=not args.no_progress)


def cmd_search(args: argparse.Namespace) -> int:
    from moend_fx.search import report

    result = run_measured(args, csv_list(args.budgets), args.out)
    print(report.markdown(result["budgets"], result["text"]), end="")
    paths = report.write(result["budgets"], result["text"], result["points"], args.out)
    print(json.dumps({k: str(v) for k, v in paths.items()}))
    return 0


def add_measured_args(p: argparse.ArgumentParser, *, trials_flag: str, trials_default: int,
                      runtime: bool = True) -> None:
    """The options of a measured search (shared with ``compare-solvers --measured-trials`` and ``bench search``;
    ``runtime``: also --threads and --no-progress, which every benchmark has already)."""
    from moend_fx.search import Objectives, SearchSampler, SearchSettings, SearchSpace

    d = SearchSettings()
    p.add_argument(trials_flag, dest="search_trials", type=int, default=trials_default,
                   help="trials in the study in all, seeds included, over every worker (default %(default)s)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="embedded model name or HF folder (default %(default)s)")
    p.add_argument("--study", default=None,
                   help="study name (with several budgets, a prefix: NAME-BUDGET); default: named after the problem")
    p.add_argument("--radius", type=int, default=d.radius,
                   help="each layer may move this many places (by bytes) from a seed plan's config (default "
                        "%(default)s)")
    p.add_argument("--space", default=str(d.space), choices=names(SearchSpace),
                   help="moves: a seed plan with two layers moved (an exchange of bytes); layers: every layer "
                        "within --radius at once (default %(default)s)")
    p.add_argument("--objectives", default=str(d.objectives), choices=names(Objectives),
                   help="kl: the KL under the budget; kl_bytes: a two-objective front (default %(default)s)")
    p.add_argument("--search-sampler", dest="sampler", default=None, choices=names(SearchSampler),
                   help="default: tpe, or nsga2 with --objectives kl_bytes")
    p.add_argument("--search-seed", dest="seed", type=int, default=d.seed,
                   help="sampler seed (give each worker its own)")
    p.add_argument("--sequences", type=positive_int, default=d.text.search,
                   help="held-out sequences searched on (default %(default)s)")
    p.add_argument("--check", type=int, default=d.text.check,
                   help="further held-out sequences the winners are re-measured on; 0 for extra workers "
                        "(default %(default)s)")
    p.add_argument("--tokens", type=positive_int, default=CALIBRATION_TOKENS,
                   help="context tokens of each sequence, and the plans' context length (default %(default)s)")
    p.add_argument("--continuation", type=positive_int, default=d.text.continuation,
                   help="teacher-forced tokens the KL is measured on (default %(default)s)")
    p.add_argument("--text-seed", type=int, default=d.text.seed, help="seed of the held-out text (default 1)")
    p.add_argument("--lock-timeout", type=float, default=d.lock_timeout,
                   help="seconds to wait for another process's SQLite lock (default %(default)s)")
    if runtime:
        p.add_argument("--threads", type=int, default=0, help="torch threads (default 0 = all cores)")
        p.add_argument("--no-progress", action="store_true", help="no progress bars")


def register(subparsers: Any) -> None:
    from moend_fx.search import SearchSettings

    p = subparsers.add_parser(
        "search", help="search plans on measured KL around greedy and exact (an Optuna study, many workers)",
        description="One worker of an Optuna study whose objective is the measured continuation KL of a plan "
                    "under the budget. Start it several times with one --storage and --study to share the study.")
    p.add_argument("--budgets", default="14x", help="comma-separated budgets, one study each (default %(default)s)")
    p.add_argument("--storage", default=None,
                   help="optuna storage: sqlite:///file.db (default: OUT/study.db), a journal file path (several "
                        "processes on one machine), or an RDB URL (several machines)")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for search.json / .md / .png (default %(default)s)")
    p.add_argument("--table", default=None,
                   help=f"sensitivity table the seed plans are solved on (default: the cached {DEFAULT_TABLE_HINT})")
    add_measured_args(p, trials_flag="--trials", trials_default=SearchSettings().trials)
    p.set_defaults(func=cmd_search)
