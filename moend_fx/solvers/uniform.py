"""The paper's ablation chain as solvers: structured plans, each the best of its family that fits.

* ``1d``: one keep ratio on every layer, 16/16 bits (eviction only, uniform).
* ``2d_uniform``: one keep ratio and one (K, V) bit pair on every layer.
* ``2d``: one keep ratio on every layer, bits chosen per layer (exact knapsack over bits per keep ratio).
* ``pyramid``: PyramidKV-style keep ratios falling linearly with depth, fixed bits (16/16 by default).

"Best" means the lowest predicted loss under the table, so these are oracle-tuned baselines: the strongest
member of each family, which is the fair thing to compare per-layer routing (MoE-nD) against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moend_fx.common.errors import PlanError
from moend_fx.plan.grid import Grid
from moend_fx.solvers.base import ArraySolution, Solver, plan_bytes_of, plan_loss, raise_infeasible
from moend_fx.solvers.exact import exact_indices


def _need_grid(grid: Grid | None, name: str) -> Grid:
    if grid is None:
        raise PlanError(f"solver {name!r} needs the table's grid (it uses keep ratios and bit widths)")
    return grid


def _columns(grid: Grid, *, keep: float | None = None, k_bits: int | None = None,
             v_bits: int | None = None) -> list[int]:
    return [i for i, c in enumerate(grid.configs)
            if (keep is None or c.keep_ratio == keep) and (k_bits is None or c.k_bits == k_bits)
            and (v_bits is None or c.v_bits == v_bits)]


def _best_uniform(S: np.ndarray, B: np.ndarray, budget: int, cols: list[int], what: str) -> ArraySolution:
    """Best single column (same config on every layer) that fits."""
    L = S.shape[0]
    loss = S[:, cols].sum(axis=0)
    used = B[:, cols].sum(axis=0)
    fits = used <= budget
    if not fits.any():
        raise_infeasible(budget, int(used.min()), what)
    # Lowest loss; ties go to fewer bytes, then the first column.
    j = int(np.lexsort((np.arange(len(cols)), used, np.where(fits, loss, np.inf)))[0])
    return ArraySolution((cols[j],) * L, len(cols), {"optimal_in_family": True, "candidates": len(cols)})


@dataclass(frozen=True)
class OneDSolver(Solver):
    """Uniform eviction, no quantization (the paper's ``1d``)."""

    name = "1d"

    def solve_arrays(self, S, B, budget, grid=None) -> ArraySolution:
        grid = _need_grid(grid, self.name)
        cols = _columns(grid, k_bits=16, v_bits=16)
        if not cols:
            raise PlanError(f"solver '1d' needs 16-bit K and V in the grid; grid is {grid.describe()}")
        return _best_uniform(S, B, budget, cols, "a uniform keep ratio at 16/16 bits (1d)")


@dataclass(frozen=True)
class TwoDUniformSolver(Solver):
    """Uniform eviction and uniform bits (the paper's ``2d_uniform``)."""

    name = "2d_uniform"

    def solve_arrays(self, S, B, budget, grid=None) -> ArraySolution:
        return _best_uniform(S, B, budget, list(range(S.shape[1])), "one config on every layer (2d_uniform)")


@dataclass(frozen=True)
class TwoDSolver(Solver):
    """Uniform eviction, per-layer bits (the paper's ``2d``): exact over bits for each keep ratio."""

    name = "2d"

    def solve_arrays(self, S, B, budget, grid=None) -> ArraySolution:
        grid = _need_grid(grid, self.name)
        best: tuple[float, int, tuple[int, ...]] | None = None
        minimum = None
        for keep in grid.keep_ratios:
            cols = np.asarray(_columns(grid, keep=keep))
            sub_min = int(B[:, cols].min(axis=1).sum())
            minimum = sub_min if minimum is None else min(minimum, sub_min)
            if sub_min > budget:
                continue
            sub, _ = exact_indices(S[:, cols], B[:, cols], budget)
            idx = tuple(int(cols[i]) for i in sub)
            cand = (plan_loss(S, idx), plan_bytes_of(B, idx), idx)
            if best is None or cand[:2] < best[:2]:
                best = cand
        if best is None:
            raise_infeasible(budget, int(minimum), "a uniform keep ratio with per-layer bits (2d)")
        return ArraySolution(best[2], len(grid.keep_ratios), {"optimal_in_family": True})


def pyramid_keeps(num_layers: int, top: float, bottom: float) -> np.ndarray:
    """[L] keep ratio schedule falling linearly from ``top`` (layer 0) to ``bottom`` (last layer)."""
    if num_layers == 1:
        return np.array([top])
    return top + (bottom - top) * np.arange(num_layers) / (num_layers - 1)


def snap_down(schedule: np.ndarray, keeps: tuple[float, ...]) -> np.ndarray:
    """[L] index into sorted ``keeps`` of the largest grid value <= the schedule (the smallest if none)."""
    ks = np.asarray(sorted(keeps))
    pos = np.searchsorted(ks, schedule + 1e-12, side="right") - 1  # 1e-12: 0.1 + ... rounding
    return np.clip(pos, 0, len(ks) - 1)


@dataclass(frozen=True)
class PyramidSolver(Solver):
    """PyramidKV-style: keep ratios decreasing linearly with depth, fixed K/V bits.

    Searches schedules from ``top`` at layer 0 to ``bottom`` at the last layer over ``steps`` x ``steps``
    values in [min keep, 1] (top >= bottom, so flat schedules are included), snaps each layer down to the
    grid and keeps the lowest-loss schedule that fits.
    """

    name = "pyramid"
    k_bits: int = 16
    v_bits: int = 16
    steps: int = 19

    def solve_arrays(self, S, B, budget, grid=None) -> ArraySolution:
        grid = _need_grid(grid, self.name)
        if self.k_bits not in grid.k_bits or self.v_bits not in grid.v_bits:
            raise PlanError(f"pyramid bits K{self.k_bits}/V{self.v_bits} are not in the grid "
                            f"{grid.describe()}")
        L = S.shape[0]
        ks = sorted(grid.keep_ratios)
        col_of = np.asarray([_columns(grid, keep=k, k_bits=self.k_bits, v_bits=self.v_bits)[0] for k in ks])
        values = np.linspace(ks[0], 1.0, self.steps)
        best: tuple[float, int, tuple[int, ...]] | None = None
        minimum = None
        tried = 0
        for top in values:
            for bottom in values[values <= top + 1e-12]:
                idx = tuple(int(i) for i in col_of[snap_down(pyramid_keeps(L, top, bottom), tuple(ks))])
                tried += 1
                used = plan_bytes_of(B, idx)
                minimum = used if minimum is None else min(minimum, used)
                if used > budget:
                    continue
                cand = (plan_loss(S, idx), used, idx)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is None:
            raise_infeasible(budget, int(minimum), f"a pyramid schedule at K{self.k_bits}/V{self.v_bits}")
        return ArraySolution(best[2], tried, {"optimal_in_family": False, "schedules": tried})

