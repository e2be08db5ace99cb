"""``moend bench {decode,solvers,calibrate,kernels,eval,all}``: benchmarks that write JSON + Markdown (+ PNG)
under ``--out`` (default ``results/bench``) and update their section of ``docs/results.md``.

Each section of ``docs/results.md`` starts with the command that regenerates it, rebuilt from the parsed
options (only those that differ from the defaults, plus ``--out``). ``moend bench all`` runs each benchmark
through the same parser with modest defaults (``--quick``: smaller still), so its sections carry the same
kind of command. See ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from moend_fx.bench.report import KEYS, render_results, write_section
from moend_fx.cli.args import positive_int
from moend_fx.common.errors import MoendError

DEFAULT_OUT = "results/bench"
DEFAULT_DOC = "docs/results.md"

# The evaluation published in docs/results.md (`moend bench eval` and `moend bench all` run it by default).
# 4x is left out: every method that fits it stays within a few points of the full cache.
PUBLISHED_EVAL: dict[str, Any] = {
    "tasks": ("passkey", "niah_single"),
    "lengths": (2048, 4096),
    "n": 30,
    "budgets": ("8x", "14x", "20x"),
    "methods": ("full", "hf_quant4", "hf_fp8", "1d", "2d_uniform", "2d", "pyramid", "2d_hetero", "2d_hetero_exact"),
}

# `moend bench all`: extra arguments per benchmark (modest defaults), and with --quick.
ALL_ARGS: dict[str, list[str]] = {
    "solvers": ["--trials", "200,2000"],
    "calibrate": [],
    "kernels": ["--lengths", "2048,8192,32768", "--runs", "20"],
    "decode": [],
    "eval": [],
    "proxy": [],
}
QUICK_ARGS: dict[str, list[str]] = {
    "solvers": ["--repeats", "5"],
    "calibrate": ["--tokens", "512"],
    "kernels": ["--lengths", "2048,8192", "--runs", "5"],
    "decode": ["--lengths", "512,1024", "--steps", "4", "--warmup", "1", "--methods", "full_eager,moend_eager"],
    "eval": ["--n", "2", "--lengths", "1024"],
    "proxy": ["--sequences", "2", "--tokens", "512", "--plans", "6"],
}


def _csv(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(s) for s in _csv(text))
    except ValueError:
        vals = ()
    if not vals or any(v <= 0 for v in vals):
        raise MoendError(f"{what}={text!r} is invalid; allowed: comma-separated positive integers (e.g. 2048,4096)")
    return vals


def command_line(args: argparse.Namespace) -> str:
    """``moend bench KEY --opt value ...`` for the options that differ from their defaults (and --out)."""
    parser: argparse.ArgumentParser = args._parser
    words = ["moend", "bench", args.bench]
    for action in parser._actions:
        # --doc and --no-progress change where results are published and what is printed, not the figures.
        if (not action.option_strings or action.dest in ("help", "doc", "no_progress")
                or action.dest.startswith("_")):
            continue
        value = getattr(args, action.dest, None)
        if action.dest not in ("out",) and value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction):
            if value:
                words.append(flag)
        else:
            words += [flag, str(value)]
    return " ".join(shlex.quote(w) for w in words)


def _threads(args: argparse.Namespace) -> None:
    import torch

    from moend_fx.bench.decode import all_cores

    n = args.threads or all_cores()
    torch.set_num_threads(n)


def _finish(args: argparse.Namespace, key: str, markdown: str, files: dict[str, Any]) -> None:
    out = Path(args.out)
    write_section(out, key, command_line(args), markdown, files)
    for kind, path in files.items():
        print(f"{kind}: {path}")
    doc = _doc_path(args)
    if doc is not None and not getattr(args, "_in_all", False):
        print(f"updated {render_results(out, doc)}")


def _doc_path(args: argparse.Namespace) -> Path | None:
    if args.doc == "":
        return None
    doc = Path(args.doc)
    if not doc.parent.is_dir():  # not run from a checkout: nothing to update
        print(f"note: {doc.parent}/ does not exist here; {doc} not updated", file=sys.stderr)
        return None
    return doc


# --------------------------------------------------------------------------------------------- handlers


def cmd_decode(args: argparse.Namespace) -> int:
    from moend_fx.bench.decode import DecodeBenchSettings, parse_methods
    from moend_fx.bench.suite import bench_decode_section
    from moend_fx.plan.routing import LayerConfig

    _threads(args)
    parts = _csv(args.uniform)
    try:
        uniform = LayerConfig(float(parts[0]), int(parts[1]), int(parts[2]))
        if len(parts) != 3:
            raise ValueError
    except (ValueError, IndexError):
        raise MoendError(f"--uniform={args.uniform!r} is invalid; allowed: KEEP,KBITS,VBITS (e.g. 0.25,4,4)") from None
    settings = DecodeBenchSettings(lengths=_ints(args.lengths, "--lengths"), steps=args.steps, warmup=args.warmup,
                                   methods=parse_methods(args.methods), budget=args.budget, uniform=uniform,
                                   bandwidth_gbs=args.bandwidth, seed=args.seed, kernel=args.kernel,
                                   inner=args.inner)
    out = Path(args.out) / "decode"
    table = args.table
    if table is None and args.plan is None:
        from moend_fx.bench.suite import default_table_path

        cached = default_table_path(args.model)
        if cached.is_file():  # the greedy plan on the calibrated table, as published
            table = str(cached)
        else:
            print(f"moend bench decode: no table at {cached}: the MoENDCache rows use the uniform plan "
                  f"{args.uniform} (run `moend calibrate` for the solver's plan)", file=sys.stderr)
    md, files, _ = bench_decode_section(args.model, settings, table_path=table, plan_path=args.plan, out=out,
                                        progress=not args.no_progress)
    print(md)
    _finish(args, "decode", md, files)
    return 0


def cmd_solvers(args: argparse.Namespace) -> int:
    from moend_fx.bench.suite import bench_solvers_section, default_table_path

    table = args.table
    if table is None:
        cached = default_table_path(args.model)
        table = str(cached) if cached.is_file() else "synthetic:30"
    trials = _ints(args.trials, "--trials") if args.trials else ()
    md, files = bench_solvers_section(table, _csv(args.budgets), trials=trials, repeats=args.repeats,
                                      context_length=args.context_length, out=Path(args.out) / "solvers")
    print(md)
    _finish(args, "solvers", md, files)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from moend_fx.bench.suite import bench_calibrate_section

    _threads(args)
    md, files = bench_calibrate_section(args.model, tokens=args.tokens, sequences=args.sequences,
                                        out=Path(args.out) / "calibrate", progress=not args.no_progress)
    print(md)
    _finish(args, "calibrate", md, files)
    return 0


def cmd_kernels(args: argparse.Namespace) -> int:
    from moend_fx.bench.suite import bench_kernels_section

    _threads(args)
    md, files = bench_kernels_section(_ints(args.lengths, "--lengths"), runs=args.runs,
                                      out=Path(args.out) / "kernels")
    print(md)
    _finish(args, "kernels", md, files)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from moend_fx.bench.suite import bench_eval_section, default_table_path
    from moend_fx.eval.config import EvalConfig

    _threads(args)
    cfg = EvalConfig(tasks=tuple(_csv(args.tasks)), lengths=_ints(args.lengths, "--lengths"), n=args.n,
                     budgets=tuple(_csv(args.budgets)), methods=tuple(_csv(args.methods)),
                     settings=tuple(_csv(args.settings)), max_new_tokens=args.max_new_tokens)
    table = args.table or str(default_table_path(args.model))
    md, files = bench_eval_section(args.model, table, cfg, out=Path(args.out) / "eval",
                                   progress=not args.no_progress)
    print(md)
    _finish(args, "eval", md, files)
    return 0


def cmd_proxy(args: argparse.Namespace) -> int:
    from moend_fx.bench.suite import bench_proxy_section, default_table_path
    from moend_fx.eval.proxy import ProxySettings

    _threads(args)
    settings = ProxySettings(sequences=args.sequences, tokens=args.tokens, random_plans=args.plans)
    table = args.table or str(default_table_path(args.model))
    md, files = bench_proxy_section(args.model, table, settings, out=Path(args.out) / "proxy",
                                    progress=not args.no_progress)
    print(md)
    _finish(args, "proxy", md, files)
    return 0


def cmd_all(args: argparse.Namespace) -> int:
    from moend_fx.cli import build_parser

    only = _csv(args.only) if args.only else list(KEYS)
    skip = set(_csv(args.skip)) if args.skip else set()
    bad = [k for k in [*only, *skip] if k not in KEYS]
    if bad:
        raise MoendError(f"benchmark {bad[0]!r} is unknown; allowed: {', '.join(KEYS)}")
    parser = build_parser()
    failed: list[str] = []
    for key in [k for k in KEYS if k in only and k not in skip]:
        argv = ["bench", key, "--out", args.out, "--doc", args.doc,
                *(QUICK_ARGS if args.quick else ALL_ARGS)[key]]
        if args.threads:
            argv += ["--threads", str(args.threads)]
        if args.no_progress:
            argv.append("--no-progress")
        sub = parser.parse_args(argv)
        sub._in_all = True
        print(f"== {command_line(sub)}", flush=True)
        try:
            sub.func(sub)
        except MoendError as e:  # one benchmark's problem must not lose the others' results
            print(f"moend bench {key}: error: {e}", file=sys.stderr)
            failed.append(key)
    doc = _doc_path(args)
    if doc is not None:
        print(f"updated {render_results(args.out, doc)}")
    if failed:
        print(f"moend: error: benchmark(s) failed: {', '.join(failed)} (the others' results were written)",
              file=sys.stderr)
        return 2
    return 0


# --------------------------------------------------------------------------------------------- parser



def _common(p: argparse.ArgumentParser, *, threads: bool = True) -> None:
    p.add_argument("--out", default=DEFAULT_OUT, help="results folder (default %(default)s)")
    p.add_argument("--doc", default=DEFAULT_DOC,
                   help="results document to update (default %(default)s; '' to leave it alone)")
    if threads:
        p.add_argument("--threads", type=int, default=0, help="torch threads (default 0 = all cores)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def register(subparsers: Any) -> None:
    from moend_fx.bench.decode import DEFAULT_BANDWIDTH_GBS, METHODS

    b = subparsers.add_parser("bench", help="benchmarks: decode, eval, solvers, proxy, calibrate, kernels, all",
                              description="Each benchmark writes JSON + Markdown (+ PNG) under --out and "
                                          "updates its section of docs/results.md.")
    sub = b.add_subparsers(dest="bench", metavar="BENCHMARK", parser_class=type(b))
    b.set_defaults(func=lambda a: (b.print_help(), 2)[1])

    d = sub.add_parser("decode", help="per-token decode time and memory: full vs MoENDCache, eager vs compiled",
                       description="One run, every method at every context length; ratios against full_eager.")
    d.add_argument("--model", default="smollm2-135m", help="embedded model name or HF folder")
    d.add_argument("--lengths", default="2048,4096,8192", help="context lengths (default %(default)s)")
    d.add_argument("--steps", type=positive_int, default=16, help="measured decode steps (median; default 16)")
    d.add_argument("--warmup", type=int, default=3, help="warm-up decode steps (pay compilation; default 3)")
    d.add_argument("--methods", default="all", help=f"'all' or a comma list of {', '.join(METHODS)}")
    d.add_argument("--table", default=None, help="sensitivity table: the MoENDCache plan is solved on it (greedy; "
                   "default: the cached $MOEND_CACHE/tables/<model>-trig-2048.safetensors, else --uniform)")
    d.add_argument("--plan", default=None, help="plan JSON for the MoENDCache rows (instead of --table)")
    d.add_argument("--budget", default="14x", help="budget for --table (default 14x of the 16-bit cache)")
    d.add_argument("--uniform", default="0.25,4,4",
                   help="without --table/--plan: KEEP,KBITS,VBITS on every layer (default %(default)s)")
    d.add_argument("--bandwidth", type=float, default=DEFAULT_BANDWIDTH_GBS,
                   help="memory bandwidth in GB/s for the roofline (default %(default)s)")
    d.add_argument("--kernel", default="auto", help="moend backend kernel: auto, cpu, triton, reference")
    d.add_argument("--inner", default="inductor", help="moend backend inner compiler: inductor, aot_eager, eager")
    d.add_argument("--seed", type=int, default=0, help="seed of the random context tokens")
    _common(d)
    d.set_defaults(func=cmd_decode, _parser=d)

    s = sub.add_parser("solvers", help="solver speed and gaps to the exact optimum",
                       description="compare-solvers + timing on one table.")
    s.add_argument("--model", default="smollm2-135m", help="model whose cached table is the default")
    s.add_argument("--table", default=None,
                   help="table file or synthetic:LAYERS[:SEED] (default: the cached SmolLM2 table, else "
                        "synthetic:30)")
    s.add_argument("--budgets", default="4x,8x,14x", help="comma-separated budgets (default %(default)s)")
    s.add_argument("--trials", default="", help="optuna trial counts, e.g. 200,2000 (default: none)")
    s.add_argument("--repeats", type=positive_int, default=20, help="greedy timing repeats (default %(default)s)")
    s.add_argument("--context-length", type=positive_int, default=None, help="tokens (default: the table's)")
    _common(s, threads=False)
    s.set_defaults(func=cmd_solvers, _parser=s)

    c = sub.add_parser("calibrate", help="time the calibration (54 configs per layer)")
    c.add_argument("--model", default="smollm2-135m")
    c.add_argument("--tokens", type=positive_int, default=2048, help="calibration tokens (default %(default)s)")
    c.add_argument("--sequences", type=positive_int, default=1)
    _common(c)
    c.set_defaults(func=cmd_calibrate, _parser=c)

    k = sub.add_parser("kernels", help="decode attention micro-benchmark (fused CPU kernel vs SDPA)")
    k.add_argument("--lengths", default="2048,8192,32768", help="held tokens (default %(default)s)")
    k.add_argument("--runs", type=positive_int, default=30, help="timed calls per method (median)")
    _common(k)
    k.set_defaults(func=cmd_kernels, _parser=k)

    e = sub.add_parser("eval", help="accuracy vs memory: the published configuration by default (about an hour "
                                    "on 2 cores; resumes from --out)")
    e.add_argument("--model", default="smollm2-135m")
    e.add_argument("--table", default=None, help="table (default $MOEND_CACHE/tables/<model>-trig-2048.safetensors)")
    e.add_argument("--tasks", default=",".join(PUBLISHED_EVAL["tasks"]), help="default %(default)s")
    e.add_argument("--lengths", default=",".join(map(str, PUBLISHED_EVAL["lengths"])), help="default %(default)s")
    e.add_argument("--n", type=positive_int, default=PUBLISHED_EVAL["n"],
                   help="examples per task and length (default %(default)s)")
    e.add_argument("--budgets", default=",".join(PUBLISHED_EVAL["budgets"]), help="default %(default)s")
    e.add_argument("--methods", default=",".join(PUBLISHED_EVAL["methods"]), help="default %(default)s")
    e.add_argument("--settings", default="query_aware,query_agnostic")
    e.add_argument("--max-new-tokens", type=positive_int, default=24)
    _common(e)
    e.set_defaults(func=cmd_eval, _parser=e)

    x = sub.add_parser("proxy", help="validate the calibration proxy against end-to-end KL on held-out text")
    x.add_argument("--model", default="smollm2-135m")
    x.add_argument("--table", default=None, help="table (default $MOEND_CACHE/tables/<model>-trig-2048.safetensors)")
    x.add_argument("--sequences", type=positive_int, default=8, help="held-out sequences (default %(default)s)")
    x.add_argument("--tokens", type=positive_int, default=2048, help="context tokens each (default %(default)s)")
    x.add_argument("--plans", type=positive_int, default=24, help="random plans (default %(default)s)")
    _common(x)
    x.set_defaults(func=cmd_proxy, _parser=x)

    a = sub.add_parser("all", help="run every benchmark and rewrite docs/results.md",
                       description="Runs " + ", ".join(KEYS) + " with modest defaults (--quick: smaller).")
    a.add_argument("--quick", action="store_true", help="small settings (minutes, not an hour)")
    a.add_argument("--only", default=None, help=f"comma list of {', '.join(KEYS)}")
    a.add_argument("--skip", default=None, help="comma list of benchmarks to skip")
    _common(a)
    a.set_defaults(func=cmd_all, _parser=a)
