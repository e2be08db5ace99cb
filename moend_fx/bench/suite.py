"""The benchmarks behind ``moend bench {solvers,calibrate,kernels,eval,decode,prefill}``: each runs, writes JSON +
Markdown (+ PNG) into its own folder and returns ``(markdown, files)`` for its ``docs/results.md`` section.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from moend_fx.calibration.tables import load_table, require_table, table_context_length
from moend_fx.common.defaults import CALIBRATION_TOKENS
from moend_fx.common.errors import MoendError
from moend_fx.common.io import atomic_save_figure, atomic_write_text

Files = dict[str, Path]


def _model_and_table(model_name: str, table_path: Path) -> tuple[Any, Any, Any]:
    """The model, its tokenizer and a sensitivity table that exists (a clear error otherwise)."""
    from moend_fx.models import load_model

    table = require_table(table_path)
    model, tok = load_model(model_name)
    return model, tok, table


def _machine() -> dict[str, Any]:
    return {"threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine()}


# --------------------------------------------------------------------------------------------- solvers


def bench_solvers_section(table_spec: str, budgets: Sequence[str], *, trials: Sequence[int] = (),
                          repeats: int = 20, context_length: int | None = None,
                          out: str | os.PathLike) -> tuple[str, Files]:
    """compare_solvers + bench_solvers on one table (a file or ``synthetic:LAYERS[:SEED]``)."""
    from moend_fx.solvers.compare import bench_solvers, compare_solvers, markdown_table, write_comparison

    table = load_table(table_spec)
    ctx = table_context_length(table, context_length or None)
    result = compare_solvers(table, list(budgets), context_length=ctx, trials=list(trials))
    files = write_comparison(result, out)
    speed = bench_solvers(table, list(budgets), list(trials), context_length=ctx, repeats=repeats)
    files["speed_json"] = atomic_write_text(Path(out) / "speed.json", json.dumps(speed, indent=1) + "\n")
    lines = [f"Table: `{table_spec}`.", "", markdown_table(result).rstrip(), "",
             f"Solve time ({repeats} repeats for greedy, median):", "",
             "| budget | greedy median | greedy max | exact median | greedy gap to exact |"
             + "".join(f" optuna@{n} time | optuna@{n} gap |" for n in trials),
             "| --- | ---: | ---: | ---: | ---: |" + " ---: | ---: |" * len(trials)]
    for b, f in speed["budgets"].items():
        gap = "" if f["greedy_gap_pct"] is None else f"{f['greedy_gap_pct']:.2f}%"
        row = (f"| {b} | {f['greedy_median_ms']:.2f} ms | {f['greedy_max_ms']:.2f} ms | "
               f"{f['exact_median_ms']:.1f} ms | {gap} |")
        for n in trials:
            g = f.get(f"optuna@{n}_gap_pct")
            row += f" {f[f'optuna@{n}_s']:.1f} s | {'' if g is None else f'{g:.2f}%'} |"
        lines.append(row)
    return "\n".join(lines) + "\n", files


# --------------------------------------------------------------------------------------------- calibrate


def bench_calibrate_section(model_name: str, *, tokens: int = CALIBRATION_TOKENS, sequences: int = 1,
                            out: str | os.PathLike, progress: bool = True) -> tuple[str, Files]:
    """Time :func:`moend_fx.calibration.pipeline.calibrate` (one prefill, then every grid config per layer)."""
    from moend_fx.calibration.pipeline import calibrate
    from moend_fx.models import load_model

    t0 = time.perf_counter()
    model, tok = load_model(model_name)
    load_s = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), time.process_time()
    table = calibrate(model, tok, tokens=tokens, num_sequences=sequences, progress=progress)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    fig = {"model": model_name, "layers": table.num_layers, "configs": len(table.grid), "tokens": tokens,
           "sequences": sequences, "wall_s": wall, "cpu_s": cpu, "load_s": load_s, **_machine()}
    out = Path(out)
    files = {"json": atomic_write_text(out / "calibrate.json", json.dumps(fig, indent=1) + "\n")}
    md = ("| model | layers x configs | tokens x sequences | wall | CPU | threads |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: |\n"
          f"| {model_name} | {fig['layers']} x {fig['configs']} | {tokens} x {sequences} | {wall:.1f} s | "
          f"{cpu:.1f} s | {fig['threads']} |\n\n"
          f"Model load ({load_s:.1f} s) not included.\n")
    files["markdown"] = atomic_write_text(out / "calibrate.md", md)
    return md, files


# --------------------------------------------------------------------------------------------- proxy


def bench_proxy_section(model_name: str, table_path: str | os.PathLike, settings: Any, *,
                        out: str | os.PathLike, progress: bool = True) -> tuple[str, Files]:
    """Wrap :func:`moend_fx.eval.proxy.validate_proxy` (held-out KL vs the table's predicted loss)."""
    from moend_fx.eval.proxy import markdown_report, validate_proxy, write_report

    table_path = Path(table_path)
    model, tok, table = _model_and_table(model_name, table_path)
    result = validate_proxy(model, tok, table, settings, progress=progress)
    j, m = write_report(result, out)
    return markdown_report(result), {"json": j, "markdown": m}


# --------------------------------------------------------------------------------------------- kernels


def bench_kernels_section(lengths: Sequence[int], *, runs: int = 30, out: str | os.PathLike) -> tuple[str, Files]:
    """Wrap ``moend_fx.kernels.bench`` (one decode attention call over a compressed layer)."""
    try:
        from moend_fx.kernels import bench as kbench
    except ImportError as e:
        raise MoendError(f"the kernel benchmark is not available ({e}); moend_fx.kernels.bench is missing") from None
    rows = kbench.bench_decode(tuple(lengths), runs=runs)
    md = kbench.to_markdown(rows)
    out = Path(out)
    files = {"json": atomic_write_text(out / "kernels.json", json.dumps(rows, indent=1) + "\n"),
             "markdown": atomic_write_text(out / "kernels.md", md),
             "plot": _plot_kernels(rows, out / "kernels.png")}
    return md, files


def bench_triton_section(lengths: Sequence[int], batches: Sequence[int], *, runs: int = 50,
                         out: str | os.PathLike) -> tuple[str, Files]:
    """Wrap ``moend_fx.kernels.bench_cuda`` (one decode attention call on a CUDA GPU)."""
    from moend_fx.kernels import bench_cuda

    rows = bench_cuda.bench_triton(tuple(lengths), tuple(batches), runs=runs)
    md = bench_cuda.to_markdown(rows)
    out = Path(out)
    return md, {"json": atomic_write_text(out / "triton.json", json.dumps(rows, indent=1) + "\n"),
                "markdown": atomic_write_text(out / "triton.md", md)}


def _plot_kernels(rows: list[dict], path: Path) -> Path:

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, threads in dict.fromkeys((r["method"], r.get("threads", 0)) for r in rows):
        pts = sorted((r["tokens"], r["ms"]) for r in rows if r["method"] == name and r.get("threads", 0) == threads)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if threads != 1 else ".",
                label=f"{name} ({threads} thr)" if threads else name,
                linestyle="--" if name.startswith("reference") else (":" if threads == 1 else "-"))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("held tokens")
    ax.set_ylabel("ms per decode attention call (median)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return atomic_save_figure(fig, path)


# --------------------------------------------------------------------------------------------- eval


def bench_eval_section(model_name: str, table_path: str | os.PathLike | None, configs: Sequence[Any], *,
                       out: str | os.PathLike, progress: bool = True) -> tuple[str, Files]:
    """Wrap the evaluation runner (``moend eval``) over one or more parts (EvalConfigs that differ only in tasks,
    lengths and n; ``moend_fx.eval.parts``), all into one records file and one report; resumes from ``out``.
    table_path: one table for every setting, or None for each setting's cached default."""
    from moend_fx.calibration.tables import setting_tables
    from moend_fx.eval.report import write_report
    from moend_fx.eval.runner import Runner
    from moend_fx.models import load_model

    if not configs:
        raise MoendError("no evaluation parts to run")
    # A resumed run solves plans only for what it still runs: keep those of the report it resumes from.
    plans = _previous_plans(Path(out) / "results.json")
    tables, paths, warnings = setting_tables(model_name, configs[0].settings, table_path)
    for why in warnings:
        print(f"moend bench eval: warning: {why}", file=sys.stderr)
    model, tok = load_model(model_name)
    skipped: dict[str, str] = {}
    for config in configs:  # each part resumes from the records of those before it and returns them all
        runner = Runner(model, tok, tables, config, progress=progress)
        result = runner.run(out, resume=True)
        plans.update(result.plans)
        skipped.update(runner.skipped)
    config = dict(result.meta["config"], tasks=sorted({t for c in configs for t in c.tasks}),
                  lengths=sorted({n for c in configs for n in c.lengths}),
                  n="/".join(map(str, sorted({c.n for c in configs}))))
    meta = dict(result.meta, config=config, parts=[c.to_dict() for c in configs], model_name=model_name,
                table_path=str(paths[configs[0].settings[0]]), table_paths={str(s): str(p) for s, p in paths.items()})
    paths = write_report(result.records, out, meta=meta, plans=plans)
    md_path = paths.get("md") or paths.get("markdown")
    md = Path(md_path).read_text() if md_path else ""
    if skipped:
        md += "\nSkipped methods: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()) + "\n"
    return md, {k: Path(v) for k, v in paths.items()}


def _previous_plans(path: Path) -> dict[str, Any]:
    """The plans of the report at ``path`` (``{}`` if there is none yet)."""
    if not path.is_file():
        return {}
    try:
        return dict(json.loads(path.read_text()).get("plans") or {})
    except (json.JSONDecodeError, AttributeError):
        raise MoendError(f"{path} is not an evaluation report (results.json); delete it to write a new one") from None


def bench_heads_section(model_name: str, table_path: str | os.PathLike | None, settings: Any, *,
                        out: str | os.PathLike, progress: bool = True) -> tuple[str, Files]:
    """Run :class:`moend_fx.bench.head_budgets.HeadBudgetBench` (per-KV-head budgets, simulated; resumes from
    ``out``). table_path: one table for every setting, or None for each setting's cached default."""
    from moend_fx.bench.head_budgets import HeadBudgetBench
    from moend_fx.bench.head_report import write_report
    from moend_fx.calibration.tables import setting_tables
    from moend_fx.models import load_model

    tables, _, warnings = setting_tables(model_name, settings.settings, table_path)
    for why in warnings:
        print(f"moend bench heads: warning: {why}", file=sys.stderr)
    model, tok = load_model(model_name)
    records = HeadBudgetBench(model, tok, tables, settings, progress=progress).run(out, resume=True)
    paths = write_report(records, settings, out)
    return paths["markdown"].read_text(), {k: Path(v) for k, v in paths.items()}


# --------------------------------------------------------------------------------------------- decode


def bench_decode_section(model_name: str, settings: Any, *, table_path: str | None = None,
                         plan_path: str | None = None, out: str | os.PathLike,
                         progress: bool = True) -> tuple[str, Files, dict[str, Any]]:
    """Load the model (and the table or plan) and run :func:`moend_fx.bench.decode.bench_decode`."""
    from moend_fx.bench.decode import bench_decode, markdown_table, write_decode
    from moend_fx.models import load_model

    table = plan = None
    if table_path and plan_path:
        raise MoendError("give --table or --plan, not both")
    if table_path:
        table = load_table(table_path)
    if plan_path:
        from moend_fx.plan.routing import RoutingPlan

        if not Path(plan_path).is_file():
            raise MoendError(f"plan file {plan_path!r} does not exist")
        plan = RoutingPlan.load(plan_path)
    model, _ = load_model(model_name)
    result = bench_decode(model, settings, table=table, plan=plan, progress=progress,
                          log=lambda s: print(s, file=sys.stderr, flush=True))
    result["meta"]["model_name"] = model_name
    result["meta"]["table"] = table_path
    files = write_decode(result, out)
    return markdown_table(result), files, result



# --------------------------------------------------------------------------------------------- prefill


def bench_prefill_section(model_name: str, settings: Any, *, table_path: str | None = None,
                          plan_path: str | None = None, out: str | os.PathLike,
                          progress: bool = True) -> tuple[str, Files]:
    """Run :func:`moend_fx.bench.prefill.bench_prefill` (each mode in its own process) and write its report."""
    from moend_fx.bench.prefill import bench_prefill, markdown_table, write_prefill

    result = bench_prefill(model_name, settings, table=table_path, plan=plan_path, progress=progress)
    return markdown_table(result), write_prefill(result, out)
