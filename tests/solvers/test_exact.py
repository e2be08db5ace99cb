import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.common.errors import BudgetError
from moend_fx.plan.memory import format_bytes
from moend_fx.solvers import get_solver
from moend_fx.solvers.base import plan_loss
from moend_fx.solvers.exact import exact_indices, lower_hull, pareto_configs
from moend_fx.solvers.synthetic import synthetic_table
from tests.solvers.helpers import brute_force, fitted_loss, problems, small_table

# Relative tolerance for comparing two sums of the same floats added in possibly different orders.
RTOL = 1e-9


@settings(max_examples=25, deadline=None)
@given(problems(max_layers=4, max_configs=6))
def test_exact_equals_brute_force(p):
    assert fitted_loss(exact_indices, *p) == pytest.approx(brute_force(*p), rel=RTOL, abs=1e-12)


@settings(max_examples=25, deadline=None)
@given(problems(max_layers=5, max_configs=6), st.integers(1, 40))
def test_raising_the_budget_never_raises_exact_loss(p, extra):
    S, B, budget = p
    lo = plan_loss(S, exact_indices(S, B, budget)[0])
    hi = plan_loss(S, exact_indices(S, B, budget + extra)[0])
    assert hi <= lo + RTOL * max(1.0, lo)


@settings(max_examples=25, deadline=None)
@given(problems(feasible=False))
def test_infeasible_budget_raises_with_minimum(p):
    S, B, budget = p
    minimum = int(B.min(1).sum())
    with pytest.raises(BudgetError) as e:
        exact_indices(S, B, budget)
    assert str(minimum) in str(e.value) and format_bytes(minimum) in str(e.value)


def test_exact_on_paper_sized_table_beats_or_ties_greedy():
    t = synthetic_table(30, seed=0)
    for b in ("4x", "8x", "14x"):
        ex = get_solver("exact").solve(t, b, context_length=2048)
        gr = get_solver("greedy").solve(t, b, context_length=2048)
        assert ex.bytes_used <= ex.budget.bytes and ex.info["optimal"] is True
        assert ex.predicted_loss <= gr.predicted_loss + RTOL
        assert ex.info["lower_bound"] <= ex.predicted_loss + RTOL  # the LP bound is a lower bound


def test_exact_table_infeasible_message_is_human():
    t = small_table(3)
    with pytest.raises(BudgetError, match="minimum feasible budget"):
        get_solver("exact").solve(t, "1000x", context_length=512)


def test_pareto_configs_drop_dominated():
    S = np.array([0.5, 0.4, 0.9, 0.1, 0.1])
    B = np.array([10, 10, 5, 20, 30])
    assert pareto_configs(S, B).tolist() == [2, 1, 3]


def test_lower_hull_drops_points_above_chords():
    b = np.array([0, 1, 2, 10])
    s = np.array([10.0, 9.9, 5.0, 0.0])
    assert lower_hull(b, s).tolist() == [0, 2, 3]
