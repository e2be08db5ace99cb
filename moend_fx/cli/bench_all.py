"""``moend bench all``: every benchmark in turn through the same parser, with modest defaults (``--quick``: smaller
still), then ``docs/results.md`` rendered once."""

from __future__ import annotations

import argparse
import sys

from moend_fx.bench.report import KEYS, render_results
from moend_fx.cli.args import csv_list
from moend_fx.cli.bench_commands import command_line, doc_path
from moend_fx.common.errors import MoendError

# `moend bench all`: extra arguments per benchmark (modest defaults), and with --quick.
ALL_ARGS: dict[str, list[str]] = {
    "solvers": ["--trials", "200,2000"],
    "calibrate": [],
    "kernels": ["--lengths", "2048,8192,32768", "--runs", "20"],
    "decode": [],
    "prefill": [],
    "eval": [],
    "proxy": [],
    "search": [],
    "heads": [],
    "triton": [],
}
QUICK_ARGS: dict[str, list[str]] = {
    "solvers": ["--repeats", "5"],
    "calibrate": ["--tokens", "512"],
    "kernels": ["--lengths", "2048,8192", "--runs", "5"],
    "decode": ["--lengths", "512,1024", "--steps", "4", "--warmup", "1", "--methods", "full_eager,moend_eager"],
    "prefill": ["--length", "1024", "--chunk", "256"],
    "eval": ["--n", "2", "--lengths", "1024"],
    "proxy": ["--sequences", "2", "--tokens", "512", "--plans", "6"],
    "search": ["--budgets", "8x", "--trials", "4", "--tokens", "512", "--sequences", "2", "--check", "1"],
    "heads": ["--n", "1", "--length", "512", "--budgets", "8x"],
    "triton": ["--lengths", "8192", "--batches", "1", "--runs", "10"],
}
# Benchmarks that need a CUDA GPU: `bench all` skips them (with a note) where torch sees none.
NEEDS_CUDA = frozenset({"triton"})


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def cmd_all(args: argparse.Namespace) -> int:
    from moend_fx.cli import build_parser

    only = csv_list(args.only) if args.only else list(KEYS)
    skip = set(csv_list(args.skip)) if args.skip else set()
    bad = [k for k in [*only, *skip] if k not in KEYS]
    if bad:
        raise MoendError(f"benchmark {bad[0]!r} is unknown; allowed: {', '.join(KEYS)}")
    parser = build_parser()
    failed: list[str] = []
    for key in [k for k in KEYS if k in only and k not in skip]:
        if key in NEEDS_CUDA and not _has_cuda():
            print(f"== moend bench {key}: skipped (needs a CUDA GPU; torch sees none here)", flush=True)
            continue
        argv = ["bench", key, "--out", args.out, "--doc", args.doc, *(QUICK_ARGS if args.quick else ALL_ARGS)[key]]
        if args.threads:
            argv += ["--threads", str(args.threads)]
        if args.no_progress:
            argv.append("--no-progress")
        sub = parser.parse_args(argv)
        sub.in_all = True  # the document is rendered once, after every benchmark
        print(f"== {command_line(sub)}", flush=True)
        try:
            sub.func(sub)
        except MoendError as e:  # one benchmark's problem must not lose the others' results
            print(f"moend bench {key}: error: {e}", file=sys.stderr)
            failed.append(key)
    doc = doc_path(args)
    if doc is not None:
        print(f"updated {render_results(args.out, doc)}")
    if failed:
        print(f"moend: error: benchmark(s) failed: {', '.join(failed)} (the others' results were written)",
              file=sys.stderr)
        return 2
    return 0
