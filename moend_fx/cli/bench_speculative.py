"""``moend bench speculative``: self-speculative decoding vs plain greedy decoding (:mod:`moend_fx.bench.speculative`);
writes speculative.json and speculative.md under ``--out``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from moend_fx.bench.speculative import SpeculativeBenchSettings
from moend_fx.calibration.tables import default_table_path
from moend_fx.cli.args import int_list, positive_int
from moend_fx.common.defaults import DEFAULT_MODEL


def add_parser(sub: Any, common: Any) -> None:
    """Register ``speculative`` on the ``moend bench`` subparsers; ``common`` adds the shared options."""
    d = SpeculativeBenchSettings()
    p = sub.add_parser("speculative", help="self-speculative decoding (compressed cache drafts, full cache verifies) "
                       "vs plain greedy decoding: tokens/s and acceptance")
    p.add_argument("--model", default=DEFAULT_MODEL, help="embedded model name or HF folder")
    p.add_argument("--contexts", default=",".join(map(str, d.contexts)), help="comma list of prompt lengths")
    p.add_argument("--batches", default=",".join(map(str, d.batches)),
                   help="comma list of batch sizes (rows decoded together; default %(default)s)")
    p.add_argument("--own-tokens", type=positive_int, default=d.own_tokens,
                   help="tokens at the end of each row's prompt of its own (the rest is shared; default %(default)s)")
    p.add_argument("--lock", default=None, help="a lock file each (context, batch)'s timed decodes hold (flock), "
                   "the prefills not (start the run under nice), e.g. /tmp/moend_bench.lock")
    p.add_argument("--new-tokens", type=positive_int, default=d.new_tokens, help="tokens decoded (default %(default)s)")
    p.add_argument("--draft-tokens", type=positive_int, default=d.draft_tokens, help="draft tokens per round")
    p.add_argument("--budget", default=d.budget, help="budget solved on the model's table (default %(default)s)")
    p.add_argument("--name", default="speculative", help="record file names under --out: NAME.json, NAME.md "
                   "(one per run, e.g. speculative-16384; the published table reads every speculative*.json)")
    p.add_argument("--ties", action="store_true", help="instead: whether assisted generation and prompt lookup on a "
                   "prepared model give plain greedy's tokens, and how near a tie each difference is "
                   "(moend_fx.bench.speculative_ties; --contexts are the prompt lengths)")
    p.add_argument("--plan-context", type=positive_int, default=2048, help="--ties: the plan's context length")
    p.add_argument("--reserve", type=int, default=0, help="--ties: MoENDCache(reserve=...) (default %(default)s)")
    p.add_argument("--table", default=None, help="sensitivity table (default: the model's cached one)")
    common(p, cmd_speculative)


def _ties(args: argparse.Namespace, model: Any, tokenizer: Any, table: Any) -> dict[str, Any]:
    from moend_fx.bench.speculative_ties import TieSettings, bench_ties
    from moend_fx.models import load_model

    draft, _ = load_model(args.model)  # the unprepared model as the assistant: a second copy of the weights
    settings = TieSettings(lengths=tuple(int_list(args.contexts, "--contexts", example="1024,2000")),
                           new_tokens=args.new_tokens, budget=args.budget, plan_context=args.plan_context,
                           reserve=args.reserve, assistant_tokens=args.draft_tokens)
    from moend_fx.bench.speculative import write_results
    from moend_fx.bench.speculative_ties import ties_markdown
    from moend_fx.cli.bench_commands import command_line

    name = "ties" if args.name == "speculative" else args.name
    return bench_ties(model, draft, tokenizer, settings, table=table, on_prompt=lambda result: write_results(
        result, Path(args.out), command_line(args), name, ties_markdown))  # what is measured so far


def cmd_speculative(args: argparse.Namespace) -> int:
    import torch

    from moend_fx.bench.decode import all_cores
    from moend_fx.bench.speculative import bench_speculative, markdown_table, write_results
    from moend_fx.calibration.tables import load_table
    from moend_fx.cli.bench_commands import command_line
    from moend_fx.models import load_model

    settings = SpeculativeBenchSettings(contexts=tuple(int_list(args.contexts, "--contexts", example="4096,8192")),
                                        batches=tuple(int_list(args.batches, "--batches", example="1,8")),
                                        new_tokens=args.new_tokens, draft_tokens=args.draft_tokens,
                                        budget=args.budget, own_tokens=args.own_tokens)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or all_cores())
    try:
        model, tokenizer = load_model(args.model)
        cached = default_table_path(args.model)
        table = load_table(args.table or str(cached)) if args.table or cached.is_file() else None
        if args.ties:
            from moend_fx.bench.speculative_ties import ties_markdown

            result, markdown = _ties(args, model, tokenizer, table), ties_markdown
        else:
            result = bench_speculative(model, tokenizer, settings, table=table, lock=args.lock)
            markdown = markdown_table
    finally:
        torch.set_num_threads(threads)
    print(markdown(result))
    out, name = Path(args.out), "ties" if args.ties and args.name == "speculative" else args.name
    for kind, path in write_results(result, out, command_line(args), name, markdown).items():
        print(f"{kind}: {path}")
    return 0
