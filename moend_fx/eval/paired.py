"""Paired accuracy: every method against a reference (the full cache) on the examples both answered.

    >>> rows = paired_accuracy(records)              # reference "full"
    >>> rows[0]["diff"], rows[0]["better"], rows[0]["worse"]

At n = 20-40 an accuracy's own interval is +-12-20 points, wider than the 5- and 10-point margins the
evaluation's goals are stated in; most examples are answered (or missed) by both caches, so the difference on the
same examples is far better determined than two separate means. A row per (setting, length, method, budget) holds
the task-averaged accuracies of the method and the reference over the paired examples, their difference with a
95% stratified bootstrap interval (each task's per-example differences resampled on their own, task means
averaged: the summary's ``avg`` rule), and the examples the method answers better / worse than the reference
(scores compared per example: a niah_multivalue score is a fraction).

An example is (task, seed, index): records of runs with different seeds pool without colliding
(:mod:`moend_fx.eval.pool`). Records from before records carried their seed count as seed None.

A pair is only as good as its two records' common ground. Within one ``moend eval`` invocation every method of an
example compresses a copy of one prefill; records copied in from another run (an older folder seeded into a new
one, another machine) carry another prefill's numerics, and at 8k tokens those alone moved the full cache's
query-aware answers on 5 of 20 examples (docs/results.md, "The full cache in the same run"). Records name their
invocation (``run``), and each row counts its pairs that cross invocations.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from moend_fx.eval.summary import METHOD_ORDER, budget_key, stratified_bootstrap

REFERENCE = "full"

Example = tuple[str, Any, int]  # (task, seed, index)


def example_key(record: dict[str, Any]) -> Example:
    """The example a record answered: (task, seed or None, index)."""
    return record["task"], record.get("seed"), record["index"]


def paired_accuracy(records: Iterable[dict[str, Any]], reference: str = REFERENCE, *, n_boot: int = 2000,
                    seed: int = 0) -> list[dict[str, Any]]:
    """Rows (dicts) per (setting, target_length, method, budget) for each method other than ``reference`` (at
    the same budget when the reference has one, e.g. ``"2d_hetero"``; with every budget when it has none):
    ``n`` paired examples, ``unpaired`` scored examples the reference did not answer, ``mean`` and
    ``reference_mean`` (task averages over the paired examples), ``diff`` = mean - reference_mean with ``low`` /
    ``high`` (95% stratified bootstrap, ``n_boot`` replicates from ``seed``), ``better`` / ``worse`` (examples
    whose score is above / below the reference's), ``cross_run`` (pairs whose two records come from two
    ``moend eval`` invocations, so from two prefills: their ``run`` fields differ) and ``run_unknown`` (pairs with a
    record made before records named their run).
    Infeasible runs (score None) are not paired. Empty when no record is the reference's."""
    scores: dict[tuple, dict[Example, float]] = defaultdict(dict)
    runs: dict[tuple, dict[Example, Any]] = defaultdict(dict)
    for r in records:
        if r.get("score") is not None:
            cell = (r["setting"], r["target_length"], r["method"], r["budget"])
            scores[cell][example_key(r)] = float(r["score"])
            runs[cell][example_key(r)] = r.get("run")
    rows = []
    for (setting, length, method, budget), ours in scores.items():
        # a budgeted reference is paired at the same budget; a budget-free one (the full cache) with every budget
        ref_cell = next((c for c in ((setting, length, reference, budget), (setting, length, reference, None))
                         if c in scores), None)
        if method == reference or ref_cell is None:
            continue
        ref, ours_run, ref_run = scores[ref_cell], runs[(setting, length, method, budget)], runs[ref_cell]
        common = sorted(set(ours) & set(ref), key=repr)
        if not common:
            continue
        tasks = sorted({k[0] for k in common})
        per_task = [[ours[k] - ref[k] for k in common if k[0] == t] for t in tasks]
        diff, low, high = stratified_bootstrap(per_task, n_boot=n_boot, seed=seed)
        rows.append(dict(
            setting=setting, target_length=length, method=method, budget=budget, reference=reference,
            n=len(common), unpaired=len(ours) - len(common), tasks=tasks, seeds=sorted({k[1] for k in common},
                                                                                       key=repr),
            mean=_task_mean(ours, common, tasks), reference_mean=_task_mean(ref, common, tasks),
            diff=diff, low=low, high=high,
            better=sum(ours[k] > ref[k] for k in common), worse=sum(ours[k] < ref[k] for k in common),
            cross_run=sum(None not in (ours_run[k], ref_run[k]) and ours_run[k] != ref_run[k] for k in common),
            run_unknown=sum(None in (ours_run[k], ref_run[k]) for k in common),
        ))
    order = {m: i for i, m in enumerate(METHOD_ORDER)}
    rows.sort(key=lambda r: (r["setting"], r["target_length"], budget_key(r["budget"]),
                             order.get(r["method"], len(order)), r["method"]))
    return rows


def _task_mean(scores: dict[Example, float], keys: list[Example], tasks: list[str]) -> float:
    """The mean over ``tasks`` of each task's mean score over ``keys``."""
    means = []
    for t in tasks:
        xs = [scores[k] for k in keys if k[0] == t]
        means.append(sum(xs) / len(xs))
    return sum(means) / len(means)
