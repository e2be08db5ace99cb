import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.common.errors import BudgetError, PlanError
from moend_fx.plan.routing import Grid
from moend_fx.solvers import get_solver
from moend_fx.solvers.last_resort import NARROW_K_MIN_KEEP, last_resort_columns
from moend_fx.solvers.uniform import pyramid_keeps, snap_down
from tests.solvers.helpers import small_table

CTX = 512
RTOL = 1e-9  # sums of the same floats


def _ratio_budget(t, ratio):
    return int(t.bytes_matrix(CTX).max(1).sum() / ratio)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 1000), st.floats(1.0, 6.0))
def test_structural_constraints(seed, ratio):
    t = small_table(5, seed=seed)
    budget = _ratio_budget(t, ratio)
    cases = {
        "1d": lambda cs: len({c.keep_ratio for c in cs}) == 1 and all(c.k_bits == c.v_bits == 16 for c in cs),
        "2d_uniform": lambda cs: len(set(cs)) == 1,
        "2d": lambda cs: len({c.keep_ratio for c in cs}) == 1,
        "pyramid": lambda cs: all(a.keep_ratio >= b.keep_ratio for a, b in zip(cs, cs[1:]))
        and all(c.k_bits == c.v_bits == 16 for c in cs),
    }
    for name, ok in cases.items():
        try:
            res = get_solver(name).solve(t, budget, context_length=CTX)
        except BudgetError as e:
            assert "minimum feasible budget" in str(e)
            continue
        assert res.bytes_used <= budget, name
        assert ok(res.plan.layers), (name, res.plan.layers)


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 1000), st.floats(1.0, 4.0))
def test_uniform_baselines_are_best_in_family(seed, ratio):
    t = small_table(3, seed=seed)
    budget = _ratio_budget(t, ratio)
    B, S, cfg = t.bytes_matrix(CTX), t.S, t.grid.configs
    rows = np.arange(3)

    last_resort = last_resort_columns(t.grid, NARROW_K_MIN_KEEP)

    def best(pred):
        """(last-resort layers, loss) of the family's best plan: the fewest last-resort layers, then least loss."""
        out = None
        for idx in itertools.product(range(len(cfg)), repeat=3):
            cs = [cfg[i] for i in idx]
            if pred(cs) and B[rows, idx].sum() <= budget:
                key = (int(last_resort[list(idx)].sum()), S[rows, idx].sum())
                out = key if out is None else min(out, key)
        return out

    fams = {"2d_uniform": lambda cs: len(set(cs)) == 1, "2d": lambda cs: len({c.keep_ratio for c in cs}) == 1,
            "1d": lambda cs: len({c.keep_ratio for c in cs}) == 1 and all(c.k_bits == c.v_bits == 16 for c in cs)}
    for name, pred in fams.items():
        want = best(pred)
        if want is None:
            with pytest.raises(BudgetError):
                get_solver(name).solve(t, budget, context_length=CTX)
        else:
            res = get_solver(name).solve(t, budget, context_length=CTX)
            assert res.info["last_resort_layers"] == want[0], name
            assert res.predicted_loss == pytest.approx(want[1], rel=RTOL, abs=1e-12), name


def test_pyramid_schedule_and_snapping():
    keeps = pyramid_keeps(5, 1.0, 0.2)
    assert keeps[0] == 1.0 and keeps[-1] == pytest.approx(0.2) and np.all(np.diff(keeps) < 0)
    grid = (0.1, 0.25, 0.5, 1.0)
    # snapped down to the largest grid value not above the schedule; below the smallest -> the smallest
    assert snap_down(np.array([1.0, 0.8, 0.5, 0.3, 0.05]), grid).tolist() == [3, 2, 2, 1, 0]


def test_pyramid_bits_must_be_in_grid():
    t = small_table(3)
    with pytest.raises(PlanError, match="not in the grid"):
        get_solver("pyramid", k_bits=8).solve(t, "2x", context_length=CTX)


def test_1d_needs_16_bits_in_grid():
    from moend_fx.solvers.synthetic import synthetic_table

    t = synthetic_table(3, grid=Grid((0.5, 1.0), (4,), (4,)))
    with pytest.raises(PlanError, match="16-bit"):
        get_solver("1d").solve(t, "2x", context_length=CTX)


def test_baseline_infeasible_names_its_own_minimum():
    t = small_table(4)
    B = t.bytes_matrix(CTX)
    col = t.grid.index(t.grid.configs[0].__class__(0.25, 16, 16))
    minimum = int(B[:, col].sum())  # 1d's cheapest: keep 0.25 at 16/16 on every layer
    with pytest.raises(BudgetError, match=str(minimum)):
        get_solver("1d").solve(t, minimum - 1, context_length=CTX)
