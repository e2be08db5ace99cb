"""The paper's marginal-utility greedy (MoE-nD, Sec. "solver").

Every layer starts at its cheapest config (ties: lowest S, then lowest index). Then, repeatedly, across all
layers, apply the upgrade (to any config of that layer that costs more bytes and lowers S) with the largest
loss reduction per extra byte ``dS/dm`` that still fits the remaining budget; stop when none fits.

No optimality guarantee: a big upgrade with a high ratio can block a better combination of smaller ones
(see ``docs/solvers.md``); the ``exact`` solver measures the gap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moend_fx.plan.grid import Grid
from moend_fx.solvers.base import ArraySolution, Solver, min_feasible_bytes, raise_infeasible


def cheapest_configs(S: np.ndarray, B: np.ndarray) -> np.ndarray:
    """[L] int64: per layer, the cheapest config; ties broken by lowest S, then lowest index."""
    L, C = S.shape
    # lexsort: last key is primary. Index order is the final tie-break (lexsort is stable).
    out = np.empty(L, dtype=np.int64)
    for l in range(L):
        out[l] = np.lexsort((S[l], B[l]))[0]
    return out


def _row_ratios(S_l: np.ndarray, B_l: np.ndarray, cur: int) -> tuple[np.ndarray, np.ndarray]:
    """(ratio [C], extra bytes [C]) of upgrading one layer from ``cur``; ratio = -inf where not an upgrade."""
    dB = B_l - B_l[cur]
    dS = S_l[cur] - S_l
    ok = (dB > 0) & (dS > 0)
    ratio = np.full(S_l.shape, -np.inf)
    ratio[ok] = dS[ok] / dB[ok]
    return ratio, dB


def greedy_indices(S: np.ndarray, B: np.ndarray, budget: int) -> tuple[np.ndarray, int]:
    """The greedy's choice. S: [L, C] float64, B: [L, C] int64. Returns (indices [L], upgrades applied).

    Ties in ``dS/dm`` go to the lowest layer, then the lowest config index (``argmax`` takes the first).
    """
    L, C = S.shape
    cur = cheapest_configs(S, B)
    remaining = int(budget) - int(B[np.arange(L), cur].sum())
    ratio = np.empty((L, C))
    extra = np.empty((L, C), dtype=np.int64)
    for l in range(L):
        ratio[l], extra[l] = _row_ratios(S[l], B[l], cur[l])
    masked = np.empty((L, C))
    steps = 0
    while True:
        # Only rows change between steps, but the fit mask depends on the remaining budget: recompute it
        # over the whole [L, C] block (1620 cells on 30 x 54, a few microseconds).
        np.copyto(masked, ratio)
        masked[extra > remaining] = -np.inf
        flat = int(np.argmax(masked))
        if masked.flat[flat] == -np.inf:
            break
        l, c = divmod(flat, C)
        remaining -= int(extra[l, c])
        cur[l] = c
        ratio[l], extra[l] = _row_ratios(S[l], B[l], c)
        steps += 1
    return cur, steps


@dataclass(frozen=True)
class GreedySolver(Solver):
    """The paper's greedy: fast (well under 5 ms on 30 x 54), no optimality guarantee."""

    name = "greedy"

    def solve_arrays(self, S: np.ndarray, B: np.ndarray, budget: int, grid: Grid | None = None) -> ArraySolution:
        minimum = min_feasible_bytes(B)
        if budget < minimum:
            raise_infeasible(budget, minimum)
        idx, steps = greedy_indices(S, B, budget)
        return ArraySolution(tuple(int(i) for i in idx), steps, {"optimal": False})
