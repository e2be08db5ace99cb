"""Summary rows of an evaluation: one per (setting, length, task, method, budget) with n, the mean score and its
95% interval (Wilson / bootstrap, :mod:`moend_fx.eval.stats`), the measured cache bytes and ratios; task
``"avg"`` rows average the per-task means with a stratified bootstrap interval. Also the continuation-KL rows.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from moend_fx.common.errors import MoendError
from moend_fx.eval.stats import summarize

AVG = "avg"
# Row order in tables: references first, then the paper's ablation chain (== moend_fx.eval.methods.METHODS).
METHOD_ORDER = ("full", "hf_quant4", "hf_fp8", "lossless", "1d", "2d_uniform", "2d_uniform_matched", "2d", "pyramid",
                "2d_hetero", "2d_hetero_exact", "2d_hetero_anyk")
_GROUP = ("setting", "target_length", "task", "method", "budget")
MEAN_FIELDS = ("measured_bytes", "ratio16", "ratio_model", "budget_bytes", "full16_bytes", "full_model_bytes",
               "context_tokens", "decode_s", "new_tokens", "predicted_loss")
"""Record fields a summary row holds the mean of."""
PEAK_FIELDS = ("peak_bytes", "peak_ratio16")
"""Record fields a summary row holds the mean of only when every record has them (records written before they
were measured lack them: a mean over part of a row would compare other examples)."""
_PER_PROMPT = ("budget_bytes", "full16_bytes", "context_tokens", "full_model_bytes")


def mean_or_none(xs: Sequence[float | None]) -> float | None:
    """The mean of the values that are not None (None if there are none)."""
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def mean_if_all(xs: Sequence[float | None]) -> float | None:
    """The mean of ``xs`` if none is None and there is one, else None."""
    return None if not xs or any(x is None for x in xs) else sum(xs) / len(xs)  # type: ignore[arg-type]


def summarize_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Summary rows (dicts), per task and averaged over tasks (task = "avg"), sorted for reading."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        missing = [k for k in _GROUP if k not in r]
        if missing:
            raise MoendError(f"record lacks field(s) {missing}; is it from moend_fx.eval.runner?")
        groups[tuple(r[k] for k in _GROUP)].append(r)
    rows = []
    for key, rs in groups.items():
        row = dict(zip(_GROUP, key))
        scored = [r for r in rs if r.get("score") is not None]
        row["n"] = len(scored)
        row["infeasible"] = len(rs) - len(scored)
        row["infeasible_reason"] = next((r.get("infeasible") for r in rs if r.get("infeasible")), None)
        if scored:
            s = summarize([r["score"] for r in scored])
            row.update(mean=s.mean, low=s.low, high=s.high, ci=s.method)
        else:
            row.update(mean=None, low=None, high=None, ci=None)
        for f in MEAN_FIELDS:
            # Figures of a decode come from the scored records; those of the budget and the prompt from all.
            row[f] = mean_or_none([r.get(f) for r in (rs if f in _PER_PROMPT else scored)])
        for f in PEAK_FIELDS:
            row[f] = mean_if_all([r.get(f) for r in scored])
        row["shared"] = sorted({r["shared_with"] for r in rs if r.get("shared_with")})
        rows.append(row)
    rows += _averages(rows, groups)
    order = {m: i for i, m in enumerate(METHOD_ORDER)}
    rows.sort(key=lambda r: (r["setting"], r["target_length"], budget_key(r["budget"]),
                             order.get(r["method"], len(order)), r["method"], r["task"] == AVG, r["task"]))
    return rows


def budget_key(b: str | None) -> float:
    if b is None:
        return -1.0
    try:
        return float(str(b).rstrip("xX"))
    except ValueError:
        return math.inf


def stratified_bootstrap(per_task: Sequence[Sequence[float]], n_boot: int = 2000, seed: int = 0,
                         level: float = 0.95) -> tuple[float, float, float]:
    """(mean of the task means, low, high): each bootstrap replicate resamples every task's examples on its own
    and averages the task means, so tasks with different n weigh equally, as in the point estimate."""
    import numpy as np

    rng = np.random.default_rng(seed)
    arrays = [np.asarray(xs, dtype=np.float64) for xs in per_task]
    point = float(np.mean([a.mean() for a in arrays]))
    reps = np.mean([a[rng.integers(0, a.size, size=(n_boot, a.size))].mean(axis=1) for a in arrays], axis=0)
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(reps, [alpha, 1.0 - alpha])
    return point, float(lo), float(hi)


def _averages(rows: list[dict[str, Any]], groups: dict[tuple, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    by: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by[(r["setting"], r["target_length"], r["method"], r["budget"])].append(r)
    out = []
    for (setting, length, method, budget), rs in by.items():
        tasks = sorted(r["task"] for r in rs)
        feasible = [r for r in rs if r["mean"] is not None]
        row = dict(setting=setting, target_length=length, task=AVG, method=method, budget=budget,
                   tasks=tasks, n=sum(r["n"] for r in rs), infeasible=sum(r["infeasible"] for r in rs),
                   infeasible_reason=next((r["infeasible_reason"] for r in rs if r["infeasible_reason"]), None))
        if len(feasible) == len(rs):
            per_task = [[rec["score"] for rec in groups[(setting, length, t, method, budget)]
                         if rec.get("score") is not None] for t in tasks]
            mean, lo, hi = stratified_bootstrap(per_task)
            row.update(mean=mean, low=lo, high=hi, ci="stratified bootstrap")
        else:
            row.update(mean=None, low=None, high=None, ci=None)
        for f in MEAN_FIELDS:
            row[f] = mean_or_none([r[f] for r in rs])
        for f in PEAK_FIELDS:
            row[f] = mean_if_all([r[f] for r in rs])
        row["shared"] = sorted({s for r in rs for s in r["shared"]})
        out.append(row)
    return out


def summarize_continuation(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows per (context length, method, budget): mean KL(full || method), mean loss and the full cache's loss,
    measured bytes and ratios, over the sequences (records from ``runner.continuation_eval``)."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[(r.get("context_length", r["context_tokens"]), r["method"], r["budget"])].append(r)
    order = {m: i for i, m in enumerate(METHOD_ORDER)}
    rows = []
    for (length, method, budget), rs in groups.items():
        ok = [r for r in rs if r.get("kl") is not None]
        rows.append(dict(context_length=length, method=method, budget=budget, n=len(ok),
                         infeasible=len(rs) - len(ok), kl=mean_or_none([r["kl"] for r in ok]),
                         loss=mean_or_none([r["loss"] for r in ok]),
                         loss_full=mean_or_none([r["loss_full"] for r in rs]),
                         measured_bytes=mean_or_none([r["measured_bytes"] for r in ok]),
                         ratio16=mean_or_none([r.get("ratio16") for r in ok]),
                         continuation_tokens=mean_or_none([r["continuation_tokens"] for r in rs])))
    rows.sort(key=lambda r: (r["context_length"], budget_key(r["budget"]), order.get(r["method"], len(order))))
    return rows


def paired_continuation(records: Iterable[dict[str, Any]], reference: str = "2d_hetero") -> list[dict[str, Any]]:
    """Per (context length, budget, method) a paired comparison with ``reference`` at the same budget over the
    sequences both ran: ``diff`` = mean of KL(method) - KL(reference) (> 0: the reference is closer to the full
    cache), ``diff_ci`` = two standard errors of that mean, ``ref_lower`` = sequences where the reference's KL is
    lower, ``rel`` = diff / the method's mean KL. Methods without a budget (full, peers) are not paired."""
    kl: dict[tuple, dict[int, float]] = defaultdict(dict)
    for r in records:
        if r.get("kl") is not None:
            kl[(r.get("context_length", r["context_tokens"]), r["budget"], r["method"])][r["sequence"]] = r["kl"]
    order = {m: i for i, m in enumerate(METHOD_ORDER)}
    rows = []
    for (length, budget, method), other in kl.items():
        ref = kl.get((length, budget, reference), {})
        common = sorted(set(other) & set(ref))
        if method == reference or budget is None or len(common) < 2:
            continue
        d = [other[i] - ref[i] for i in common]
        mean = sum(d) / len(d)
        sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1))
        base = sum(other[i] for i in common) / len(common)
        rows.append(dict(context_length=length, budget=budget, method=method, reference=reference, n=len(d),
                         diff=mean, diff_ci=2 * sd / math.sqrt(len(d)), ref_lower=sum(x > 0 for x in d),
                         rel=mean / base if base > 0 else None))
    rows.sort(key=lambda r: (r["context_length"], budget_key(r["budget"]), order.get(r["method"], len(order))))
    return rows
