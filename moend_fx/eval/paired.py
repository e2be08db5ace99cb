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
    whose score is above / below the reference's). Infeasible runs (score None) are not paired. Empty when no
    record is the reference's."""
    scores: dict[tuple, dict[Example, float]] = defaultdict(dict)
    for r in records:
        if r.get("score") is not None:
            scores[(r["setting"], r["target_length"], r["method"], r["budget"])][example_key(r)] = float(r["score"])
    rows = []
    for (setting, length, method, budget), ours in scores.items():
        # a budgeted reference is paired at the same budget; a budget-free one (the full cache) with every budget
        ref = scores.get((setting, length, reference, budget)) or scores.get((setting, length, reference, None))
        if method == reference or ref is None:
            continue
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
