"""The plans an evaluation's MoENDCache methods use: solved once per (method, budget, context length) on a
setting's table (:class:`PlanBook`), or why none fits.

A method's solver comes from its :class:`~moend_fx.eval.methods.MethodSpec`; ``pyramid`` is solved at every bit
pair of the grid (the strongest member of the family); a ``matched_keep`` method's uniform plan is raised to the
largest keep ratio that fits (:func:`~moend_fx.solvers.matched_keep.fill_keep`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.common.errors import BudgetError
from moend_fx.common.options import ScorerName
from moend_fx.eval.methods import METHODS, MethodSpec
from moend_fx.plan.memory import parse_budget
from moend_fx.plan.routing import LayerConfig, RoutingPlan
from moend_fx.solvers import get_solver
from moend_fx.solvers.matched_keep import fill_keep


def lossless_plan(table: SensitivityTable, context_length: int) -> RoutingPlan:
    """keep 1.0, 16/16 bits on every layer (MoENDCache must then match the full cache)."""
    return RoutingPlan.uniform(LayerConfig(1.0, 16, 16), table.fingerprint, context_length, grid=table.grid,
                               group_size=table.group_size,
                               scorer=str(table.calibration.get("scorer", ScorerName.TRIG)),
                               solver="lossless")


@dataclass(frozen=True)
class PlanEntry:
    """A solved plan (or why none fits): plan None and ``infeasible`` set when the budget is too small."""

    plan: RoutingPlan | None
    budget_bytes: int | None
    predicted_loss: float | None = None
    solve_s: float = 0.0
    infeasible: str | None = None


def _pyramid_key(res: Any) -> tuple[int, float, int]:
    """Which bit pair's pyramid is best: the fewest last-resort layers (the solvers' own rule, see
    :mod:`moend_fx.solvers.last_resort`), then the lowest predicted loss, then the fewest bytes."""
    return res.info.get("last_resort_layers", 0), res.predicted_loss, res.bytes_used


class PlanBook:
    """Plans from the calibrated table, solved once per (method, budget, context length) and cached."""

    def __init__(self, table: SensitivityTable) -> None:
        self.table = table
        self._plans: dict[tuple[str, str, int], PlanEntry] = {}

    def get(self, method: str, budget: str | None, context_length: int) -> PlanEntry:
        key = (method, str(budget), int(context_length))
        if key not in self._plans:
            self._plans[key] = self._solve(METHODS[method], budget, int(context_length))
        return self._plans[key]

    def _solve(self, spec: MethodSpec, budget: str | None, length: int) -> PlanEntry:
        if spec.name == "lossless":
            return PlanEntry(lossless_plan(self.table, length), None)
        parsed = parse_budget(budget, self.table.fingerprint, length)
        if spec.solver == "pyramid":
            return self._best_pyramid(parsed.bytes, budget, length)
        try:
            res = get_solver(spec.solver, **spec.solver_options).solve(self.table, budget, context_length=length)
        except BudgetError as e:
            return PlanEntry(None, parsed.bytes, infeasible=str(e))
        if spec.matched_keep:
            res = fill_keep(res, self.table)
        return PlanEntry(res.plan, parsed.bytes, res.predicted_loss, res.wall_time_s)

    def _best_pyramid(self, budget_bytes: int, budget: str, length: int) -> PlanEntry:
        """PyramidSolver at every (K, V) bit pair of the grid; the best that fits by :func:`_pyramid_key` (the
        strongest member of the family, like the other uniform baselines)."""
        best, why = None, None
        for kb in self.table.grid.k_bits:
            for vb in self.table.grid.v_bits:
                try:
                    res = get_solver("pyramid", k_bits=kb, v_bits=vb).solve(self.table, budget,
                                                                            context_length=length)
                except BudgetError as e:
                    why = why or str(e)
                    continue
                if best is None or _pyramid_key(res) < _pyramid_key(best):
                    best = res
        if best is None:
            return PlanEntry(None, budget_bytes, infeasible=why)
        return PlanEntry(best.plan, budget_bytes, best.predicted_loss, best.wall_time_s)
