"""What a measured search found: greedy, exact and the searched plan, on the search set and on held-out text.

The searched plan is the counted complete trial with the lowest measured KL (ties: fewer bytes, then the
earlier trial). Its gain over greedy is judged against the noise of the measurement: the standard error of
the paired per-sequence differences; a gain within two of them is "within noise". Because the searched plan
was selected on the search set, its gain there is biased upward; the check set (sequences it never saw) is
the one to believe.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from moend_fx.common.io import atomic_save_figure, atomic_write_text
from moend_fx.plan.memory import format_bytes
from moend_fx.search.objective import MeasuredKL
from moend_fx.search.study import Problem, counted

ROWS: tuple[str, ...] = ("greedy", "exact", "searched")


def _complete(study: Any) -> list[Any]:
    import optuna

    return [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            if counted(t) and "kl_per_sequence" in t.user_attrs]


def pareto_front(points: list[tuple[int, float]]) -> list[int]:
    """Indices of the non-dominated (bytes, kl) points, by bytes ascending (both minimised)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], math.inf
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def paired_gain(base: list[float], new: list[float]) -> dict[str, float]:
    """Gain of ``new`` over ``base`` (KL lower is better): mean difference, its %, the paired standard error."""
    d = np.asarray(base, dtype=np.float64) - np.asarray(new, dtype=np.float64)
    se = float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else math.nan
    mean_base = float(np.mean(base))
    gain = float(d.mean())
    return {"gain": gain, "gain_pct": 100.0 * gain / mean_base if mean_base else math.nan, "se": se,
            "within_noise": bool(not (abs(gain) > 2 * se)) if not math.isnan(se) else True}


def summarise(study: Any, problem: Problem, table_configs: tuple[Any, ...], *, held: MeasuredKL | None,
              budget: str) -> dict[str, Any]:
    """JSON-ready summary of one study (see the module docstring); ``held`` re-measures the three plans."""
    trials = _complete(study)
    by_seed = {t.user_attrs["seed"]: t for t in trials if "seed" in t.user_attrs}
    chosen: dict[str, Any] = {}
    for name in ("greedy", "exact"):
        idx = list(problem.seeds[name])
        chosen[name] = next((t for t in trials if t.user_attrs["indices"] == idx), by_seed.get(name))
    best = min(trials, key=lambda t: (float(np.mean(t.user_attrs["kl_per_sequence"])), t.user_attrs["bytes"],
                                      t.number))
    chosen["searched"] = best
    rows = []
    for name in ROWS:
        t = chosen[name]
        if t is None:
            continue
        idx = t.user_attrs["indices"]
        row = {"plan": name, "trial": t.number, "indices": idx, "configs": [table_configs[i].name for i in idx],
               "bytes": t.user_attrs["bytes"], "predicted": t.user_attrs["predicted"],
               "kl_search": float(np.mean(t.user_attrs["kl_per_sequence"])),
               "kl_search_per_sequence": t.user_attrs["kl_per_sequence"]}
        if held is not None:
            row["kl_check_per_sequence"] = held.per_sequence(idx)
            row["kl_check"] = float(np.mean(row["kl_check_per_sequence"]))
        rows.append(row)
    space = {"kind": type(problem.space).__name__.lower(), "radius": problem.space.radius,
             "plans": problem.space.size, "candidates_per_layer": [len(c) for c in problem.space.candidates]}
    out = {"budget": budget, "budget_bytes": problem.budget_bytes, "study": study.study_name, "rows": rows,
           "trials": _trial_stats(study, trials), "space": space, "front": _front(trials)}
    by = {r["plan"]: r for r in rows}
    g = by["greedy"]
    for name in ("searched", "exact"):
        r, tag = by[name], "" if name == "searched" else "_exact"
        out[f"gain{tag}_search"] = paired_gain(g["kl_search_per_sequence"], r["kl_search_per_sequence"])
        if held is not None:
            out[f"gain{tag}_check"] = paired_gain(g["kl_check_per_sequence"], r["kl_check_per_sequence"])
    others = [t for t in trials if t.user_attrs["indices"] != g["indices"]]
    if others:
        o = min(others, key=lambda t: float(np.mean(t.user_attrs["kl_per_sequence"])))
        out["best_other"] = {"trial": o.number, "kl_search": float(np.mean(o.user_attrs["kl_per_sequence"])),
                             "bytes": o.user_attrs["bytes"]}
    return out


def _trial_stats(study: Any, trials: list[Any]) -> dict[str, Any]:
    starts = [t.datetime_start for t in trials if t.datetime_start]
    ends = [t.datetime_complete for t in trials if t.datetime_complete]
    all_trials = study.get_trials(deepcopy=False)
    return {"complete": len(trials), "reused": sum(bool(t.user_attrs.get("reused")) for t in trials),
            "surplus": sum(bool(t.user_attrs.get("surplus")) for t in all_trials),
            "failed": sum(t.state.name == "FAIL" and not t.user_attrs.get("surplus") for t in all_trials),
            "workers": len({t.user_attrs.get("worker") for t in trials}),
            "trial_seconds": float(sum(t.user_attrs.get("seconds", 0.0) for t in trials)),
            "wall_s": (max(ends) - min(starts)).total_seconds() if starts and ends else 0.0}


def _front(trials: list[Any]) -> list[dict[str, Any]]:
    pts = [(int(t.user_attrs["bytes"]), float(np.mean(t.user_attrs["kl_per_sequence"]))) for t in trials]
    return [{"trial": trials[i].number, "bytes": pts[i][0], "kl": pts[i][1]} for i in pareto_front(pts)]


def _gain_text(g: dict[str, float]) -> str:
    return f"{g['gain']:+.4f} +- {2 * g['se']:.4f}" + ("" if math.isnan(g["gain_pct"]) else f", {g['gain_pct']:+.1f}%")


def _verdict(s: dict[str, Any]) -> str:
    """Plain words: whether any measured plan beat greedy, and whether that survives the held-out check."""
    rows = {r["plan"]: r for r in s["rows"]}
    n = s["trials"]["complete"]
    if rows["searched"]["indices"] == rows["greedy"]["indices"]:
        other = s.get("best_other")
        tail = "" if other is None else (f"; the best other plan (trial {other['trial']}) measured "
                                         f"{other['kl_search']:.4f} vs greedy's {rows['greedy']['kl_search']:.4f}")
        return f"no plan of the {n} measured beat greedy on the search set{tail}"
    where, g = ("held-out", s["gain_check"]) if "gain_check" in s else ("search-set", s["gain_search"])
    if g["within_noise"]:
        return (f"the searched plan beat greedy on the search set ({_gain_text(s['gain_search'])}) but not beyond "
                f"noise on the {where} sequences ({_gain_text(g)}): greedy is end-to-end optimal within noise")
    word = "better" if g["gain"] > 0 else "worse"
    return f"the searched plan is {word} than greedy beyond noise on the {where} sequences ({_gain_text(g)})"


def _exact_text(s: dict[str, Any]) -> str:
    rows = {r["plan"]: r for r in s["rows"]}
    if rows["exact"]["indices"] == rows["greedy"]["indices"]:
        return "exact = greedy"
    g = s.get("gain_exact_check", s["gain_exact_search"])
    where = "held-out" if "gain_exact_check" in s else "search-set"
    judged = "within noise" if g["within_noise"] else ("better" if g["gain"] > 0 else "worse") + " beyond noise"
    return f"exact (lower predicted loss) vs greedy, {where}: {_gain_text(g)} ({judged})"


def markdown(summaries: list[dict[str, Any]], text: dict[str, Any]) -> str:
    """The report: one row per (budget, plan), then each budget's verdict."""
    lines = [f"Measured KL = mean over sequences of the mean KL(full || plan) over {text['continuation']} "
             f"teacher-forced tokens after a {text['tokens']}-token context; search set: {text['search']} held-out "
             f"sequences, check set: the next {text['check']} (seed {text['seed']}). Gain = greedy KL - plan KL "
             "(> 0: the plan is better); +- is two paired standard errors.", "",
             "| budget | plan | trial | bytes | predicted loss | KL search | KL check |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in summaries:
        for r in s["rows"]:
            check = f"{r['kl_check']:.4f}" if "kl_check" in r else "-"
            lines.append(f"| {s['budget']} | {r['plan']} | {r['trial']} | {format_bytes(r['bytes'])} | "
                         f"{r['predicted']:.4f} | {r['kl_search']:.4f} | {check} |")
    lines.append("")
    for s in summaries:
        t = s["trials"]
        lines.append(f"- {s['budget']}: {_verdict(s)}. {_exact_text(s)}. {t['complete']} trials ({t['reused']} "
                     f"repeats of a measured plan, {t['surplus']} surplus), {t['workers']} worker(s), "
                     f"{t['wall_s']:.0f} s wall, space `{s['space']['kind']}` of {s['space']['plans']:.3g} "
                     f"proposals (radius {s['space']['radius']}).")
    return "\n".join(lines) + "\n"


def plot(summaries: list[dict[str, Any]], trials_by_budget: dict[str, list[tuple[int, float]]],
         path: str | os.PathLike) -> Path:
    """Every measured trial (bytes, KL) per budget, its Pareto front, and the greedy/exact/searched plans."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summaries), figsize=(5.5 * len(summaries), 4), squeeze=False)
    for ax, s in zip(axes[0], summaries):
        pts = trials_by_budget.get(s["budget"], [])
        if pts:
            ax.scatter([p[0] / 1e6 for p in pts], [p[1] for p in pts], s=10, c="0.7", label="trials")
        front = s["front"]
        ax.plot([p["bytes"] / 1e6 for p in front], [p["kl"] for p in front], "-o", ms=3, c="C0",
                label="Pareto front")
        for r, m in zip(s["rows"], ("s", "^", "*")):
            ax.scatter([r["bytes"] / 1e6], [r["kl_search"]], marker=m, s=80, label=r["plan"], zorder=3)
        ax.set_title(f"{s['budget']} ({format_bytes(s['budget_bytes'])})")
        ax.set_xlabel("cache MB")
        ax.set_ylabel("measured KL (search set)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return atomic_save_figure(fig, path)


def trial_points(study: Any) -> list[tuple[int, float]]:
    return [(int(t.user_attrs["bytes"]), float(np.mean(t.user_attrs["kl_per_sequence"]))) for t in _complete(study)]


def write(summaries: list[dict[str, Any]], text: dict[str, Any], points: dict[str, list[tuple[int, float]]],
          out_dir: str | os.PathLike, stem: str = "search") -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"text": text, "budgets": summaries}
    return {"json": atomic_write_text(out / f"{stem}.json", json.dumps(doc, indent=1) + "\n"),
            "md": atomic_write_text(out / f"{stem}.md", markdown(summaries, text)),
            "png": plot(summaries, points, out / f"{stem}.png")}
