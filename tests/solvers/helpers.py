"""Shared strategies and a brute-force oracle for the solver tests."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import strategies as st

from moend_fx.plan.routing import Grid
from moend_fx.solvers.synthetic import synthetic_table

SMALL_GRID = Grid(keep_ratios=(0.25, 0.5, 1.0), k_bits=(16, 4), v_bits=(16, 4))  # 12 configs


@st.composite
def problems(draw, max_layers: int = 4, max_configs: int = 6, feasible: bool = True):
    """(S [L, C] float64, B [L, C] int64, budget). Small byte values on purpose: they make many ties."""
    L = draw(st.integers(1, max_layers))
    C = draw(st.integers(1, max_configs))
    S = np.array(draw(st.lists(st.floats(0.001, 10.0, allow_nan=False), min_size=L * C, max_size=L * C)))
    B = np.array(draw(st.lists(st.integers(1, 60), min_size=L * C, max_size=L * C)), dtype=np.int64)
    S, B = S.reshape(L, C), B.reshape(L, C)
    if not feasible:
        B = B + 1  # minimum >= 2, so a positive budget below it exists
    lo, hi = int(B.min(1).sum()), int(B.max(1).sum())
    budget = draw(st.integers(lo, hi + 5)) if feasible else draw(st.integers(max(1, lo - 50), lo - 1))
    return S, B, budget


def brute_force(S: np.ndarray, B: np.ndarray, budget: int) -> float | None:
    """The least loss of any plan within budget (None if none fits)."""
    best = None
    L = S.shape[0]
    for idx in itertools.product(range(S.shape[1]), repeat=L):
        if int(B[np.arange(L), idx].sum()) <= budget:
            loss = float(S[np.arange(L), idx].sum())
            best = loss if best is None else min(best, loss)
    return best


def small_table(layers: int = 6, seed: int = 0, grid: Grid = SMALL_GRID):
    return synthetic_table(layers, grid=grid, seed=seed)


def fitted_loss(solve, S: np.ndarray, B: np.ndarray, budget: int) -> float:
    """The predicted loss of ``solve(S, B, budget) -> (indices, steps)``, asserting first that it fits."""
    idx, _ = solve(S, B, budget)
    assert int(B[np.arange(S.shape[0]), idx].sum()) <= budget
    return float(S[np.arange(S.shape[0]), idx].sum())
