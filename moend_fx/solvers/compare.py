"""Run every solver on one table and several budgets; write JSON, Markdown and a plot. Also a benchmark.

Library functions so that ``moend compare-solvers``, ``moend bench`` and ``examples/solver_study.py`` share
them.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.common.errors import MoendError
from moend_fx.common.io import atomic_save_figure, atomic_write_text
from moend_fx.plan.memory import format_bytes, parse_budget
from moend_fx.solvers import get_solver
from moend_fx.solvers.base import full_cache_figures

BASE_SOLVERS: tuple[str, ...] = ("greedy", "exact", "2d", "2d_uniform", "1d", "pyramid")


def compare_solvers(
    table: SensitivityTable,
    budgets: Sequence[Any],
    *,
    context_length: int,
    trials: Sequence[int] = (200, 2000),
    solvers: Sequence[str] = BASE_SOLVERS,
    optuna_options: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Rows of (budget, solver, predicted loss, gap to exact in %, bytes used, wall time).

    ``optuna@N`` rows run Optuna with N trials (options from ``optuna_options``, default in-memory storage).
    A solver that cannot meet a budget gets a row with ``error`` set and no loss.
    """
    names = list(solvers) + [f"optuna@{n}" for n in trials]
    rows: list[dict[str, Any]] = []
    for b in budgets:
        parsed = parse_budget(b, table.fingerprint, context_length)
        exact_loss = None
        # exact first: every other row's gap is measured against it
        for name in sorted(names, key=lambda n: n != "exact"):
            if name.startswith("optuna@"):
                opts = {"storage": ":memory:", **(optuna_options or {}), "n_trials": int(name.split("@")[1])}
                solver = get_solver("optuna", **opts)
            else:
                solver = get_solver(name)
            row: dict[str, Any] = {"budget": str(b), "budget_bytes": parsed.bytes, "solver": name}
            t0 = time.perf_counter()
            try:
                res = solver.solve(table, parsed.bytes, context_length=context_length)
            except MoendError as e:
                row.update(predicted_loss=None, gap_pct=None, bytes_used=None,
                           wall_s=time.perf_counter() - t0, error=str(e))
            else:
                if name == "exact":
                    exact_loss = res.predicted_loss
                row.update(predicted_loss=res.predicted_loss, bytes_used=res.bytes_used, wall_s=res.wall_time_s,
                           iterations=res.iterations, error=None,
                           gap_pct=_gap(res.predicted_loss, exact_loss))
            rows.append(row)
            if log:
                log(_row_line(row))
    return {
        "context_length": context_length,
        "num_layers": table.fingerprint.num_layers,
        "configs": len(table.grid),
        "calibration": {k: v for k, v in table.calibration.items() if isinstance(v, (str, int, float, bool))},
        **full_cache_figures(table, context_length),
        "rows": rows,
    }


def _gap(loss: float, exact: float | None) -> float | None:
    if exact is None:
        return None
    if exact == 0:
        return 0.0 if loss == 0 else float("inf")
    return (loss - exact) / exact * 100.0


def _row_line(r: dict[str, Any]) -> str:
    if r["error"]:
        return f"{r['budget']:>8} {r['solver']:<12} infeasible/failed: {r['error'][:90]}"
    return (f"{r['budget']:>8} {r['solver']:<12} loss {r['predicted_loss']:.5f}  gap {r['gap_pct']:+.2f}%  "
            f"{format_bytes(r['bytes_used'])}  {r['wall_s'] * 1e3:.1f} ms")


def markdown_table(result: dict[str, Any]) -> str:
    lines = [
        f"Solver comparison: {result['num_layers']} layers x {result['configs']} configs, context "
        f"{result['context_length']} tokens; budgets are ratios of the 16-bit cache "
        f"({format_bytes(result['full_16bit'])}; model dtype: {format_bytes(result['full_model_dtype'])}).",
        "",
        "| budget | solver | predicted loss | gap to exact | bytes used | wall time |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        if r["error"]:
            lines.append(f"| {r['budget']} | {r['solver']} | infeasible | | | {r['wall_s'] * 1e3:.1f} ms |")
            continue
        gap = "" if r["gap_pct"] is None else f"{r['gap_pct']:.2f}%"
        lines.append(f"| {r['budget']} | {r['solver']} | {r['predicted_loss']:.5f} | {gap} | "
                     f"{format_bytes(r['bytes_used'])} | {_fmt_time(r['wall_s'])} |")
    return "\n".join(lines) + "\n"


def _fmt_time(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def plot_comparison(result: dict[str, Any], path: str | os.PathLike) -> Path:
    """PNG: predicted loss vs budget (bytes) per solver, log-scaled loss."""

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    solvers = list(dict.fromkeys(r["solver"] for r in result["rows"]))
    for name in solvers:
        pts = sorted((r["budget_bytes"], r["predicted_loss"]) for r in result["rows"]
                     if r["solver"] == name and not r["error"])
        if pts:
            ax.plot([p[0] / 1e6 for p in pts], [max(p[1], 1e-12) for p in pts], marker="o",
                    label=name, linestyle="--" if name == "exact" else "-")
    ax.set_xlabel("budget (MB)")
    ax.set_ylabel("predicted loss (sum of S)")
    ax.set_yscale("log")
    ax.set_title(f"{result['num_layers']} layers, context {result['context_length']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return atomic_save_figure(fig, path)


def write_comparison(result: dict[str, Any], out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write ``compare.json``, ``compare.md`` and ``compare.png`` into ``out_dir``."""
    out = Path(out_dir)
    return {
        "json": atomic_write_text(out / "compare.json", json.dumps(result, indent=2, default=str) + "\n"),
        "markdown": atomic_write_text(out / "compare.md", markdown_table(result)),
        "plot": plot_comparison(result, out / "compare.png"),
    }


def bench_solvers(table: SensitivityTable, budgets: Sequence[Any], trials: Sequence[int] = (),
                  *, context_length: int, repeats: int = 50) -> dict[str, Any]:
    """Wall-time figures: greedy median over ``repeats`` runs, exact median over a few, optuna once per N.

    Times the array solve only (``SolveResult.wall_time_s``), not budget parsing or plan building.
    """
    out: dict[str, Any] = {"num_layers": table.fingerprint.num_layers, "configs": len(table.grid),
                           "context_length": context_length, "repeats": repeats, "budgets": {}}
    for b in budgets:
        fig: dict[str, Any] = {}
        g = [get_solver("greedy").solve(table, b, context_length=context_length) for _ in range(repeats)]
        fig["greedy_median_ms"] = statistics.median(r.wall_time_s for r in g) * 1e3
        fig["greedy_max_ms"] = max(r.wall_time_s for r in g) * 1e3
        e = [get_solver("exact").solve(table, b, context_length=context_length) for _ in range(max(3, repeats // 10))]
        fig["exact_median_ms"] = statistics.median(r.wall_time_s for r in e) * 1e3
        fig["exact_max_states"] = e[0].info["max_states"]
        fig["greedy_gap_pct"] = _gap(g[0].predicted_loss, e[0].predicted_loss)
        for n in trials:
            r = get_solver("optuna", n_trials=n, storage=":memory:").solve(table, b, context_length=context_length)
            fig[f"optuna@{n}_s"] = r.wall_time_s
            fig[f"optuna@{n}_gap_pct"] = _gap(r.predicted_loss, e[0].predicted_loss)
        out["budgets"][str(b)] = fig
    return out
