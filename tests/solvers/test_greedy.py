import numpy as np
import pytest
from hypothesis import given, settings

from moend_fx.common.errors import BudgetError
from moend_fx.solvers import get_solver
from moend_fx.solvers.exact import exact_indices
from moend_fx.solvers.greedy import cheapest_configs, greedy_indices
from moend_fx.solvers.synthetic import synthetic_table
from tests.solvers.helpers import fitted_loss, problems, small_table


@settings(max_examples=25, deadline=None)
@given(problems(max_layers=6, max_configs=8))
def test_greedy_fits_and_is_no_better_than_exact(p):
    greedy, opt = fitted_loss(greedy_indices, *p), fitted_loss(exact_indices, *p)
    # 1e-9 relative: both losses are sums of the same floats in layer order; only ties could differ by ulps.
    assert greedy >= opt - 1e-9 * max(1.0, opt)


def test_cheapest_start_breaks_ties_by_lowest_loss_then_index():
    S = np.array([[0.5, 0.2, 0.2, 0.0]])
    B = np.array([[10, 10, 10, 20]])
    assert cheapest_configs(S, B).tolist() == [1]


def test_greedy_takes_the_best_ratio_upgrade_first():
    # Layer 0 upgrade: dS 1.0 for 10 bytes (0.1/B); layer 1: dS 0.5 for 2 bytes (0.25/B). Budget fits one.
    S = np.array([[1.0, 0.0], [0.6, 0.1]])
    B = np.array([[5, 15], [5, 7]])
    idx, steps = greedy_indices(S, B, 17)
    assert idx.tolist() == [0, 1] and steps == 1


def test_greedy_is_deterministic():
    t = synthetic_table(30, seed=3)
    a = get_solver("greedy").solve(t, "8x", context_length=2048)
    b = get_solver("greedy").solve(t, "8x", context_length=2048)
    assert a.indices == b.indices


def test_solve_result_fills_the_plan():
    t = small_table(6, seed=1)
    res = get_solver("greedy").solve(t, "6x", context_length=1024)
    plan = res.plan
    assert plan.solver == "greedy" and plan.context_length == 1024 and plan.group_size == t.group_size
    assert plan.budget_bytes == res.budget.bytes and plan.bytes_planned == res.bytes_used <= res.budget.bytes
    assert plan.predicted_loss == pytest.approx(float(sum(t.S[l, i] for l, i in enumerate(res.indices))), rel=1e-12)
    assert plan.scorer == "trig" and res.iterations >= 0 and res.wall_time_s >= 0
    assert [t.grid.index(c) for c in plan.layers] == list(res.indices)


def test_budget_strings_and_bytes_agree():
    t = small_table(4, seed=2)
    by_ratio = get_solver("greedy").solve(t, "5x", context_length=512)
    by_bytes = get_solver("greedy").solve(t, by_ratio.budget.bytes, context_length=512)
    assert by_ratio.indices == by_bytes.indices


def test_infeasible_budget_names_the_minimum():
    t = small_table(4)
    B = t.bytes_matrix(512)
    minimum = int(B.min(1).sum())
    with pytest.raises(BudgetError, match=str(minimum)):
        get_solver("greedy").solve(t, minimum - 1, context_length=512)
