"""Exact multiple-choice knapsack: a Pareto-frontier dynamic programme with an LP bound.

Layers are added one at a time. The state set after layer ``l`` holds partial plans as (bytes, loss) pairs
and keeps only the **non-dominated** ones (no other state has <= bytes and <= loss). This is exact: of two
partial plans where one dominates, any completion of the dominated one is matched or beaten by the same
completion of the other. Two more exact prunings keep the frontier small:

* **feasibility**: a state whose bytes plus the cheapest completion exceed the budget is dropped;
* **bound**: a state whose loss plus a *lower bound* on the best completion exceeds the loss of a known
  feasible plan (the greedy's) is dropped. The bound is the LP relaxation of the remaining layers
  (each layer's lower convex hull of (bytes, S), segments taken in order of ``dS/dm``), which never
  exceeds the true optimum of the rest.

Per layer, dominated configs (another config with <= bytes and <= S) are dropped first; this is also exact.
At the end, the lowest-loss state is the optimum; back-pointers give the plan. Run time depends on how tight
the bound is, not on the byte values, so no byte grid or GCD is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moend_fx.plan.grid import Grid
from moend_fx.solvers.base import (
    ArraySolution,
    Solver,
    min_feasible_bytes,
    plan_loss,
    raise_infeasible,
)
from moend_fx.solvers.greedy import greedy_indices

# Relative slack when comparing a float bound with the incumbent: bounds are sums in another order, so they
# may exceed the true value by a few ulps. Keeping too many states is safe; dropping one is not.
BOUND_RTOL = 1e-9


def pareto_configs(S_l: np.ndarray, B_l: np.ndarray) -> np.ndarray:
    """Indices of one layer's non-dominated configs, by increasing bytes (strictly decreasing S).

    S_l, B_l: [C]. Among exact duplicates the lowest index is kept.
    """
    order = np.lexsort((np.arange(len(S_l)), S_l, B_l))  # bytes, then S, then index
    s = S_l[order]
    best_before = np.concatenate(([np.inf], np.minimum.accumulate(s)[:-1]))
    return order[s < best_before]


def lower_hull(b: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Positions (into b, s) of the lower convex hull of Pareto points sorted by bytes (S decreasing)."""
    hull: list[int] = []
    for i in range(len(b)):
        while len(hull) >= 2:
            i0, i1 = hull[-2], hull[-1]
            # Drop i1 if it lies on or above the chord i0 -> i: cross product sign, in exact-ish float maths.
            if (s[i1] - s[i0]) * (b[i] - b[i0]) >= (s[i] - s[i0]) * (b[i1] - b[i0]):
                hull.pop()
            else:
                break
        hull.append(i)
    return np.asarray(hull, dtype=np.int64)


@dataclass(frozen=True)
class _Bound:
    """Piecewise-linear LP lower bound of a suffix of layers: loss >= interp(capacity, x, y)."""

    x: np.ndarray  # [K] cumulative bytes at the breakpoints, x[0] = cheapest completion
    y: np.ndarray  # [K] LP loss at the breakpoints (non-increasing)

    def __call__(self, capacity: np.ndarray) -> np.ndarray:
        out = np.interp(capacity, self.x, self.y)  # beyond x[-1]: y[-1]
        return np.where(capacity < self.x[0], np.inf, out)


def _suffix_bounds(front_b: list[np.ndarray], front_s: list[np.ndarray]) -> list[_Bound]:
    """bounds[l] bounds layers l..L-1; bounds[L] is the empty suffix (0 bytes, 0 loss)."""
    L = len(front_b)
    segs = []
    for b, s in zip(front_b, front_s):
        h = lower_hull(b, s)
        hb, hs = b[h].astype(np.float64), s[h]
        segs.append((b[0], s[0], np.diff(hb), -np.diff(hs)))  # (base bytes, base loss, dB, dS)
    bounds: list[_Bound] = [_Bound(np.zeros(1), np.zeros(1))]
    for l in range(L - 1, -1, -1):
        base_b = float(sum(seg[0] for seg in segs[l:]))
        base_s = float(sum(seg[1] for seg in segs[l:]))
        dB = np.concatenate([seg[2] for seg in segs[l:]])
        dS = np.concatenate([seg[3] for seg in segs[l:]])
        order = np.argsort(-(dS / dB), kind="stable")
        x = np.concatenate(([base_b], base_b + np.cumsum(dB[order])))
        y = np.concatenate(([base_s], base_s - np.cumsum(dS[order])))
        bounds.append(_Bound(x, y))
    bounds.reverse()
    return bounds


def exact_indices(S: np.ndarray, B: np.ndarray, budget: int, incumbent: np.ndarray | None = None
                  ) -> tuple[np.ndarray, dict]:
    """The optimum. S: [L, C] float64, B: [L, C] int64. Returns (indices [L], stats).

    ``incumbent``: a feasible plan [L] whose loss seeds the bound (default: the greedy's).
    Ties between optimal plans go to the one with fewer bytes.
    """
    L = S.shape[0]
    minimum = min_feasible_bytes(B)
    if budget < minimum:
        raise_infeasible(budget, minimum)
    if incumbent is None:
        incumbent, _ = greedy_indices(S, B, budget)
    ub = plan_loss(S, incumbent)
    slack = BOUND_RTOL * max(1.0, abs(ub))

    cfg = [pareto_configs(S[l], B[l]) for l in range(L)]
    cb = [B[l, c] for l, c in enumerate(cfg)]
    cs = [S[l, c] for l, c in enumerate(cfg)]
    bounds = _suffix_bounds(cb, cs)
    min_rest = np.concatenate((np.cumsum([b[0] for b in cb][::-1])[::-1], [0]))  # [L+1]
    root_bound = float(bounds[0](np.array([float(budget)]))[0])

    fb = np.zeros(1, dtype=np.int64)
    fs = np.zeros(1)
    parents: list[np.ndarray] = []
    choices: list[np.ndarray] = []
    max_states = 1
    for l in range(L):
        nb = (fb[:, None] + cb[l][None, :]).ravel()
        ns = (fs[:, None] + cs[l][None, :]).ravel()
        keep = nb + min_rest[l + 1] <= budget
        cap = (budget - nb).astype(np.float64)
        keep &= ns + bounds[l + 1](cap) <= ub + slack
        sel = np.flatnonzero(keep)
        # Pareto prune: sort by bytes then loss; keep states strictly better than all cheaper ones.
        order = sel[np.lexsort((ns[sel], nb[sel]))]
        s_sorted = ns[order]
        best_before = np.concatenate(([np.inf], np.minimum.accumulate(s_sorted)[:-1]))
        order = order[s_sorted < best_before]
        n_cfg = len(cb[l])
        parents.append(order // n_cfg)
        choices.append(cfg[l][order % n_cfg])
        fb, fs = nb[order], ns[order]
        max_states = max(max_states, len(order))
        if len(order) == 0:  # only possible if float slack misjudged the incumbent; it is itself optimal
            return np.asarray(incumbent, dtype=np.int64), {"max_states": max_states, "root_bound": root_bound,
                                                           "incumbent_optimal": True}
    # Frontier is sorted by bytes with strictly decreasing loss: the last state has the least loss.
    k = len(fb) - 1
    out = np.empty(L, dtype=np.int64)
    for l in range(L - 1, -1, -1):
        out[l] = choices[l][k]
        k = parents[l][k]
    return out, {"max_states": max_states, "root_bound": root_bound, "incumbent_optimal": False}


@dataclass(frozen=True)
class ExactSolver(Solver):
    """The proven optimum of the multiple-choice knapsack (Pareto DP + LP bound)."""

    name = "exact"

    def solve_arrays(self, S: np.ndarray, B: np.ndarray, budget: int, grid: Grid | None = None) -> ArraySolution:
        idx, stats = exact_indices(S, B, budget)
        return ArraySolution(tuple(int(i) for i in idx), S.shape[0],
                             {"optimal": True, "lower_bound": stats["root_bound"],
                              "max_states": stats["max_states"]})
