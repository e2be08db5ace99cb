"""``prepare``'s promise: the cache it builds fits the plan's budget at every step, or it refuses before generation.

A plan is priced for one eviction state (``moend_fx.plan.scorer_state``): the scorer it was solved for, with the
table's calibrated query statistics or not, and the default query window. ``prepare`` options can build another
one (no ``table=``: ``trig`` then estimates the statistics from a window of the last queries; ``scorer="snapkv"``
reads a window of queries; a larger ``window=``). In capacity mode every layer holds at most its cap, priced by the
memory model for the state it really has (:meth:`MoENDCache.budget_bytes`), so the caps' sum is the most the cache
ever holds. When that sum exceeds the plan's budget, :func:`check_priced` refuses with one error naming the
options that changed the price and how to re-solve (``SensitivityTable.priced_for``). Measured on SmolLM2-135M
(docs/cache.md): without the check a 14x plan ran 19% over its budget without ``table=`` and 27% over with
``scorer="snapkv"``.
"""

from __future__ import annotations

from typing import Any

from moend_fx.common.defaults import QUERY_WINDOW
from moend_fx.common.errors import BudgetError
from moend_fx.plan.memory import format_bytes
from moend_fx.plan.routing import RoutingPlan
from moend_fx.solvers import SOLVERS


def cache_state(cache: Any) -> tuple[str, bool]:
    """(scorer name, calibrated) of the evicting layers of ``cache`` (the first one's: every layer of a
    MoENDCache is built with the same scorer and the same source of statistics)."""
    for layer in cache.layers:
        scorer = layer.scorer
        if scorer is not None:
            return str(scorer.name), bool(scorer.calibrated)
    return str(cache.plan.scorer), False


def _causes(plan: RoutingPlan, options: dict[str, Any], scorer: str, calibrated: bool, table: Any) -> list[str]:
    """The prepare options that gave the cache another eviction state than the plan's, as phrases."""
    causes = []
    if "scorer" in options and scorer != plan.scorer:
        causes.append(f"scorer={scorer!r} (the plan was solved for {plan.scorer!r})")
    if not calibrated and table is None and "query_stats" not in options:
        causes.append(f"no table= (so {scorer!r} has no calibrated query statistics)")
    window = options.get("window", QUERY_WINDOW)
    if window != QUERY_WINDOW:
        causes.append(f"window={window} (plans are priced with the default window={QUERY_WINDOW})")
    return causes or [f"the cache's eviction state (scorer {scorer!r}, calibrated={calibrated})"]


def check_priced(plan: RoutingPlan, cache: Any, options: dict[str, Any], table: Any = None) -> None:
    """A :class:`BudgetError` when the most ``cache`` can hold (the sum of its layers' caps) exceeds
    ``plan.budget_bytes``. ``options``: the MoENDCache options ``prepare`` was given; ``table``: its ``table=``.

    A plan that states no price (``bytes_planned`` is None: built field by field, as in tests) promises no
    budget and is not checked; every solver and :meth:`RoutingPlan.uniform` record one."""
    if plan.bytes_planned is None:
        return
    most = cache.budget_bytes().total
    if most <= plan.budget_bytes:
        return
    scorer, calibrated = cache_state(cache)
    over = 100.0 * (most / plan.budget_bytes - 1.0)
    causes = "; ".join(_causes(plan, options, scorer, calibrated, table))
    fixes = []
    if not calibrated and table is None and scorer == plan.scorer:
        fixes.append("pass table=<the table the plan was solved on> (its calibrated query statistics)")
    if "scorer" in options and scorer != plan.scorer:
        fixes.append(f"leave scorer= out (the plan's {plan.scorer!r})")
    solver = plan.solver if plan.solver in SOLVERS else "greedy"
    fixes.append(f"re-solve the plan for this cache: get_solver({solver!r}).solve(table.priced_for("
                 f"{scorer!r}, calibrated={calibrated}), {plan.budget_bytes}, context_length={plan.context_length})")
    raise BudgetError(
        f"this cache would not keep the plan's budget: it can hold up to {most} B ({format_bytes(most)}), "
        f"{over:.1f}% over the plan's {plan.budget_bytes} B, because its eviction state is not the one the plan "
        f"was priced for ({plan.bytes_planned} B at {plan.context_length} tokens): {causes}. To keep the budget, "
        + ", or ".join(fixes)
    )
