"""The handlers of ``moend bench``: each runs one benchmark of :mod:`moend_fx.bench.suite`, stores its section
and updates ``docs/results.md`` (arguments: :mod:`moend_fx.cli.bench`)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from moend_fx.bench.report import render_results, write_section
from moend_fx.calibration.tables import default_table_path
from moend_fx.cli.args import csv_list, int_list
from moend_fx.common.errors import MoendError

# --doc and --no-progress change where results are published and what is printed, not the figures.
_NOT_IN_COMMAND = ("help", "doc", "no_progress")


def command_line(args: argparse.Namespace) -> str:
    """``moend bench KEY --opt value ...`` for the options that differ from their defaults (and --out), in the
    order they were declared (``args.declared_options``: the actions the benchmark's parser added)."""
    words = ["moend", "bench", args.bench]
    for action in args.declared_options:
        if not action.option_strings or action.dest in _NOT_IN_COMMAND:
            continue
        value = getattr(args, action.dest, None)
        if action.dest != "out" and value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:  # a flag (store_true): present or not
            if value:
                words.append(flag)
        else:
            words += [flag, str(value)]
    return " ".join(shlex.quote(w) for w in words)


def _threads(args: argparse.Namespace) -> None:
    import torch

    from moend_fx.bench.decode import all_cores

    torch.set_num_threads(args.threads or all_cores())


def _publish(args: argparse.Namespace, key: str, markdown: str, files: dict[str, Any]) -> int:
    """Print a benchmark's Markdown, store its section and (outside ``bench all``) re-render the document."""
    print(markdown)
    out = Path(args.out)
    write_section(out, key, command_line(args), markdown, files)
    for kind, path in files.items():
        print(f"{kind}: {path}")
    doc = doc_path(args)
    if doc is not None and not args.in_all:
        print(f"updated {render_results(out, doc)}")
    return 0


def doc_path(args: argparse.Namespace) -> Path | None:
    if args.doc == "":
        return None
    doc = Path(args.doc)
    if not doc.parent.is_dir():  # not run from a checkout: nothing to update
        print(f"note: {doc.parent}/ does not exist here; {doc} not updated", file=sys.stderr)
        return None
    return doc


def _cached_table(args: argparse.Namespace) -> str:
    """``--table``, else the model's cached table (whether or not it exists: the benchmark says so)."""
    return args.table or str(default_table_path(args.model))


def _uniform(text: str) -> Any:
    from moend_fx.plan.config import LayerConfig

    parts = csv_list(text)
    try:
        if len(parts) != 3:
            raise ValueError
        return LayerConfig(float(parts[0]), int(parts[1]), int(parts[2]))
    except ValueError:  # a PlanError is a ValueError too: one message for every malformed --uniform
        raise MoendError(f"--uniform={text!r} is invalid; allowed: KEEP,KBITS,VBITS (e.g. 0.25,4,4)") from None


def cmd_decode(args: argparse.Namespace) -> int:
    from moend_fx.bench.decode import DecodeBenchSettings, parse_batches, parse_methods
    from moend_fx.bench.suite import bench_decode_section

    _threads(args)
    uniform = _uniform(args.uniform)
    batch_lengths = int_list(args.batch_lengths, "--batch-lengths") if args.batch_lengths.strip() else None
    settings = DecodeBenchSettings(lengths=int_list(args.lengths, "--lengths"), steps=args.steps,
                                   warmup=args.warmup, methods=parse_methods(args.methods), budget=args.budget,
                                   uniform=uniform, bandwidth_gbs=args.bandwidth, seed=args.seed,
                                   kernel=args.kernel, inner=args.inner, batches=parse_batches(args.batches),
                                   batch_lengths=batch_lengths, memory_cap=args.memory_cap.strip() or None,
                                   evict_every=args.evict_every, reevict=args.reevict,
                                   prefill_chunk=args.prefill_chunk)
    compiled = _compiled_methods(args, settings)
    table = args.table
    if table is None and args.plan is None:
        cached = default_table_path(args.model)
        if cached.is_file():  # the greedy plan on the calibrated table, as published
            table = str(cached)
        else:
            print(f"moend bench decode: no table at {cached}: the MoENDCache rows use the uniform plan "
                  f"{args.uniform} (run `moend calibrate` for the solver's plan)", file=sys.stderr)
    out = Path(args.out) / "decode"
    md, files, result = bench_decode_section(args.model, settings, table_path=table, plan_path=args.plan,
                                             out=out, progress=not args.no_progress)
    if compiled:
        import torch

        from moend_fx.bench.compile_time import bench_compile_times
        from moend_fx.bench.decode import markdown_table, write_decode

        result["compile_times"] = bench_compile_times(args.model, settings, length=min(settings.lengths),
                                                      methods=compiled, table=table, plan=args.plan,
                                                      threads=torch.get_num_threads())
        md, files = markdown_table(result), write_decode(result, out)
    return _publish(args, "decode", md, files)


def _compiled_methods(args: argparse.Namespace, settings: Any) -> tuple[str, ...]:
    """With --compile-times: the compiled methods of --methods (checked before the long run), else ()."""
    if not args.compile_times:
        return ()
    from moend_fx.bench.compile_time import COMPILED

    compiled = tuple(m for m in settings.methods if m in COMPILED)
    if not compiled:
        raise MoendError(f"--compile-times needs a compiled method in --methods; allowed: {', '.join(COMPILED)}")
    return compiled


def cmd_prefill(args: argparse.Namespace) -> int:
    from moend_fx.bench.prefill import PrefillBenchSettings
    from moend_fx.bench.suite import bench_prefill_section

    settings = PrefillBenchSettings(length=args.length, chunk=args.chunk, modes=tuple(csv_list(args.modes)),
                                    examples=args.examples, new_tokens=args.new_tokens, budget=args.budget,
                                    uniform=_uniform(args.uniform), seed=args.seed, threads=args.threads,
                                    malloc=args.malloc)
    table = args.table
    if table is None and args.plan is None and default_table_path(args.model).is_file():
        table = str(default_table_path(args.model))  # the greedy plan on the calibrated table, as decode does
    md, files = bench_prefill_section(args.model, settings, table_path=table, plan_path=args.plan,
                                      out=Path(args.out) / "prefill", progress=not args.no_progress)
    return _publish(args, "prefill", md, files)


def cmd_solvers(args: argparse.Namespace) -> int:
    from moend_fx.bench.suite import bench_solvers_section

    table = args.table
    if table is None:
        cached = default_table_path(args.model)
        table = str(cached) if cached.is_file() else "synthetic:30"
    trials = int_list(args.trials, "--trials", example="200,2000") if args.trials else ()
    md, files = bench_solvers_section(table, csv_list(args.budgets), trials=trials, repeats=args.repeats,
                                      context_length=args.context_length, out=Path(args.out) / "solvers")
    return _publish(args, "solvers", md, files)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from moend_fx.bench.suite import bench_calibrate_section

    _threads(args)
    md, files = bench_calibrate_section(args.model, tokens=args.tokens, sequences=args.sequences,
                                        out=Path(args.out) / "calibrate", progress=not args.no_progress)
    return _publish(args, "calibrate", md, files)


def cmd_kernels(args: argparse.Namespace) -> int:
    from moend_fx.bench.suite import bench_kernels_section

    if getattr(args, "static", False):  # the Triton kernel's SASS figures: no timing, no results page
        from moend_fx.kernels.static_report import static_report

        md, files = static_report(Path(args.out) / "kernels-static")
        print(md + "".join(f"{kind}: {path}\n" for kind, path in files.items()))
        return 0
    _threads(args)
    md, files = bench_kernels_section(int_list(args.lengths, "--lengths"), runs=args.runs,
                                      out=Path(args.out) / "kernels")
    return _publish(args, "kernels", md, files)


def cmd_triton(args: argparse.Namespace) -> int:
    from moend_fx.bench.suite import bench_triton_section

    md, files = bench_triton_section(int_list(args.lengths, "--lengths"), int_list(args.batches, "--batches"),
                                     runs=args.runs, out=Path(args.out) / "triton")
    return _publish(args, "triton", md, files)


def cmd_eval(args: argparse.Namespace) -> int:
    from moend_fx.bench.published import PUBLISHED_EVAL
    from moend_fx.bench.suite import bench_eval_section
    from moend_fx.eval.config import EvalConfig
    from moend_fx.eval.parts import choose_parts

    _threads(args)
    parts = choose_parts(PUBLISHED_EVAL["parts"], tasks=csv_list(args.tasks) if args.tasks else None,
                         lengths=int_list(args.lengths, "--lengths") if args.lengths else None, n=args.n)
    configs = [EvalConfig(tasks=p.tasks, lengths=p.lengths, n=p.n, budgets=tuple(csv_list(args.budgets)),
                          methods=tuple(csv_list(args.methods)), settings=tuple(csv_list(args.settings)),
                          max_new_tokens=args.max_new_tokens) for p in parts]
    md, files = bench_eval_section(args.model, args.table, configs, out=Path(args.out) / "eval",
                                   progress=not args.no_progress)
    return _publish(args, "eval", md, files)


def cmd_proxy(args: argparse.Namespace) -> int:
    from moend_fx.bench.suite import bench_proxy_section
    from moend_fx.eval.proxy import ProxySettings

    _threads(args)
    settings = ProxySettings(sequences=args.sequences, tokens=args.tokens, random_plans=args.plans, tail=args.tail)
    md, files = bench_proxy_section(args.model, _cached_table(args), settings, out=Path(args.out) / "proxy",
                                    progress=not args.no_progress)
    return _publish(args, "proxy", md, files)


def cmd_heads(args: argparse.Namespace) -> int:
    from moend_fx.bench.head_budgets import HeadBudgetSettings
    from moend_fx.bench.suite import bench_heads_section

    _threads(args)
    settings = HeadBudgetSettings(task=args.task, length=args.length, n=args.n, budgets=tuple(csv_list(args.budgets)),
                                  settings=tuple(csv_list(args.settings)), method=args.method, alpha=args.alpha)
    md, files = bench_heads_section(args.model, args.table, settings, out=Path(args.out) / "heads",
                                    progress=not args.no_progress)
    return _publish(args, "heads", md, files)


def cmd_search(args: argparse.Namespace) -> int:
    from moend_fx.cli.search import run_measured
    from moend_fx.search import report

    _threads(args)
    out = Path(args.out) / "search"
    result = run_measured(args, csv_list(args.budgets), str(out))
    paths = report.write(result["budgets"], result["text"], result["points"], out)
    return _publish(args, "search", report.markdown(result["budgets"], result["text"]),
                    {"json": paths["json"], "markdown": paths["md"], "png": paths["png"]})
