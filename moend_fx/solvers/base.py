"""The one interface every solver shares: ``solve(table, budget, *, context_length) -> SolveResult``.

A solver sees the problem as arrays: ``S`` [L, C] float64 (predicted loss of config c on layer l), ``B`` [L, C]
int64 (bytes of config c on layer l, from the memory model) and one byte budget ``W``; it picks one config
index per layer minimising ``sum_l S[l, c_l]`` subject to ``sum_l B[l, c_l] <= W`` (a multiple-choice
knapsack). :class:`Solver` does the common work (budget parsing, the feasibility check, timing, building the
:class:`~moend_fx.plan.routing.RoutingPlan`); each solver implements :meth:`Solver.solve_arrays`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.common.checks import check_int
from moend_fx.common.errors import BudgetError, MoendError
from moend_fx.common.options import ScorerName
from moend_fx.plan.memory import Budget, format_bytes, full_cache_bytes, parse_budget
from moend_fx.plan.routing import Grid, RoutingPlan
from moend_fx.solvers.last_resort import (
    NARROW_K_MAX_CONTEXT,
    NARROW_K_MIN_KEEP,
    last_resort_columns,
    rule_min_keep,
    with_surcharge,
)


@dataclass(frozen=True)
class ArraySolution:
    """What :meth:`Solver.solve_arrays` returns: one config index per layer plus the solver's own stats."""

    indices: tuple[int, ...]
    iterations: int = 0
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SolveResult:
    """A solved plan and how it was found.

    ``indices[l]`` is the grid config index chosen for layer l; ``info`` holds solver-specific facts
    (``optimal``, ``trials``, ``lower_bound``...).
    """

    plan: RoutingPlan
    indices: tuple[int, ...]
    predicted_loss: float
    bytes_used: int
    budget: Budget
    wall_time_s: float
    iterations: int
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def solver(self) -> str:
        return self.plan.solver

    def summary(self) -> dict[str, Any]:
        """JSON-ready stats (no plan)."""
        return {
            "solver": self.solver,
            "predicted_loss": self.predicted_loss,
            "bytes_used": self.bytes_used,
            "budget_bytes": self.budget.bytes,
            "wall_time_s": self.wall_time_s,
            "iterations": self.iterations,
            **{k: v for k, v in self.info.items() if _jsonable(v)},
        }


def _jsonable(v: Any) -> bool:
    return isinstance(v, (bool, int, float, str, type(None))) or (
        isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float, str)) for x in v)
    )


def check_arrays(S: np.ndarray, B: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validate and normalise ``S`` [L, C] float64 and ``B`` [L, C] int64."""
    S = np.asarray(S, dtype=np.float64)
    B = np.asarray(B)
    if S.ndim != 2 or S.shape != B.shape or S.size == 0:
        raise MoendError(f"S and bytes must both be non-empty [layers, configs] arrays; got {S.shape} and "
                         f"{B.shape}")
    if not np.all(np.isfinite(S)):
        bad = np.argwhere(~np.isfinite(S))[0]
        raise MoendError(f"S[{bad[0]}, {bad[1]}]={S[tuple(bad)]!r} is not finite; allowed: finite floats")
    if not np.issubdtype(B.dtype, np.integer) or np.any(B <= 0):
        raise MoendError("bytes must be positive integers for every (layer, config)")
    return S, B.astype(np.int64)


def min_feasible_bytes(B: np.ndarray) -> int:
    """The least bytes any plan can take: every layer at its cheapest config."""
    return int(B.min(axis=1).sum())


def raise_infeasible(budget: int, minimum: int, what: str = "any plan") -> None:
    raise BudgetError(
        f"budget {budget} bytes ({format_bytes(budget)}) is below the minimum feasible budget for {what}: "
        f"{minimum} bytes ({format_bytes(minimum)}); raise the budget to at least that"
    )


def plan_loss(S: np.ndarray, indices: np.ndarray | tuple[int, ...]) -> float:
    """``sum_l S[l, c_l]``, always summed in layer order so that every solver's figure compares exactly."""
    idx = np.asarray(indices, dtype=np.int64)
    return float(np.sum(S[np.arange(S.shape[0]), idx]))


def plan_bytes_of(B: np.ndarray, indices: np.ndarray | tuple[int, ...]) -> int:
    idx = np.asarray(indices, dtype=np.int64)
    return int(np.sum(B[np.arange(B.shape[0]), idx]))


@dataclass(frozen=True)
class Solver:
    """Base class: subclasses are frozen dataclasses of options and implement :meth:`solve_arrays`.

    ``narrow_k_min_keep``: keys of 4 bits or fewer on a layer that keeps fewer than this share of its tokens are
    a last resort (:mod:`moend_fx.solvers.last_resort`): :meth:`solve` hands :meth:`solve_arrays` a loss with
    those configs surcharged, so a plan uses them only where nothing else fits; 0 turns the rule off.
    ``narrow_k_max_context``: the rule covers plans for contexts of at most this many tokens (0: every length).
    The plan's ``predicted_loss`` is always the table's own.
    """

    name: ClassVar[str] = "base"
    narrow_k_min_keep: float = NARROW_K_MIN_KEEP
    narrow_k_max_context: int = NARROW_K_MAX_CONTEXT

    def solve_arrays(self, S: np.ndarray, B: np.ndarray, budget: int, grid: Grid | None = None) -> ArraySolution:
        """Pick one config per layer. S: [L, C] float64; B: [L, C] int64; ``budget`` in bytes.

        ``grid`` is needed only by solvers that use the configs' structure (the uniform baselines).
        Raises :class:`BudgetError` if no allowed plan fits.
        """
        raise NotImplementedError

    def solve(
        self,
        table: SensitivityTable,
        budget: Any,
        *,
        context_length: int,
        batch: int = 1,
        **kw: Any,
    ) -> SolveResult:
        """Solve ``table`` for ``budget`` (int bytes, "136MB", "14x" of a 16-bit cache of ``context_length``).

        Keyword arguments override this solver's options for this call (e.g. ``n_trials=50``).
        """
        if kw:
            names = {f.name for f in dataclasses.fields(self)}
            unknown = sorted(set(kw) - names)
            if unknown:
                raise MoendError(f"solver {self.name!r} has no option(s) {unknown}; allowed: {sorted(names)}")
            return dataclasses.replace(self, **kw).solve(table, budget, context_length=context_length,
                                                         batch=batch)
        check_int("context_length", context_length)
        fp = table.fingerprint
        parsed = parse_budget(budget, fp, context_length, batch)
        S, B = check_arrays(table.loss, table.bytes_matrix(context_length, batch))
        if S.shape != (fp.num_layers, len(table.grid)):
            raise MoendError(f"table S has shape {S.shape}; expected [num_layers={fp.num_layers}, "
                             f"configs={len(table.grid)}]")
        barred = last_resort_columns(table.grid, rule_min_keep(self.narrow_k_min_keep, self.narrow_k_max_context,
                                                               context_length))
        t0 = time.perf_counter()
        sol = self.solve_arrays(with_surcharge(S, barred), B, parsed.bytes, table.grid)
        wall = time.perf_counter() - t0
        idx = tuple(int(i) for i in sol.indices)
        loss = plan_loss(S, idx)
        used = plan_bytes_of(B, idx)
        if used > parsed.bytes:  # a solver bug, never a user error
            raise AssertionError(f"solver {self.name} returned a plan of {used} bytes over budget {parsed.bytes}")
        configs = table.grid.configs
        plan = RoutingPlan(
            layers=tuple(configs[i] for i in idx),
            fingerprint=fp,
            budget_bytes=parsed.bytes,
            context_length=context_length,
            grid=table.grid,
            group_size=table.group_size,
            # the scorer the bytes were priced for (SensitivityTable.priced_for), so prepare builds that one
            scorer=str(table.pricing[0] if table.pricing else table.calibration.get("scorer", ScorerName.TRIG)),
            solver=self.name,
            predicted_loss=loss,
            bytes_planned=plan_bytes_of(B, idx) if batch == 1 else plan_bytes_of(
                table.bytes_matrix(context_length, 1), idx),
        )
        info = {**sol.info, "last_resort_layers": int(barred[list(idx)].sum())}
        return SolveResult(plan, idx, loss, used, parsed, wall, sol.iterations, info)


def full_cache_figures(table: SensitivityTable, context_length: int, batch: int = 1) -> dict[str, int]:
    """Bytes of the uncompressed cache: 16-bit (the ratio base) and the model's own dtype."""
    return {
        "full_16bit": full_cache_bytes(table.fingerprint, context_length, batch, dtype="16bit"),
        "full_model_dtype": full_cache_bytes(table.fingerprint, context_length, batch, dtype=None),
    }
