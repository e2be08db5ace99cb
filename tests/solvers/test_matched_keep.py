"""fill_keep: a uniform plan raised to the largest keep ratio that fits its budget (uniform at matched bytes)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.common.errors import BudgetError, PlanError
from moend_fx.plan.memory import keep_count, keep_floor, plan_bytes
from moend_fx.plan.routing import Grid, LayerConfig, RoutingPlan
from moend_fx.solvers import get_solver
from moend_fx.solvers.matched_keep import fill_keep, interpolated_loss, largest_keep
from tests.solvers.helpers import small_table

GRID = Grid(keep_ratios=(0.1, 0.25, 0.5, 1.0), k_bits=(16, 8, 4), v_bits=(16, 8, 4))


def _budget(t, ctx, ratio):
    return int(t.bytes_matrix(ctx).max(1).sum() / ratio)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 1000), st.integers(200, 1500), st.floats(2.0, 12.0))
def test_fill_spends_the_budget_and_no_more(seed, ctx, ratio):
    t = small_table(4, seed=seed, grid=GRID)
    budget = _budget(t, ctx, ratio)
    try:
        base = get_solver("2d_uniform").solve(t, budget, context_length=ctx)
    except BudgetError:
        return
    res = fill_keep(base, t)
    (c0,), (c,) = set(base.plan.layers), set(res.plan.layers)
    assert (c.k_bits, c.v_bits) == (c0.k_bits, c0.v_bits)  # the baseline's bits, only the keep ratio moves
    assert c.keep_ratio >= c0.keep_ratio
    # the memory model the cache uses agrees with the fill's own count, and the budget holds
    assert plan_bytes(res.plan, calibrated=t.has_stats()) == res.bytes_used <= budget
    assert res.plan.bytes_planned == res.bytes_used and res.plan.budget_bytes == budget
    # the largest whole token count that fits: every larger count is over the budget
    n = keep_count(ctx, c.keep_ratio, keep_floor(res.plan))
    assert n == round(c.keep_ratio * ctx)
    for m in range(n + 1, ctx + 1):
        assert t.num_layers * t.config_bytes(LayerConfig(m / ctx, c.k_bits, c.v_bits), ctx) > budget, m
    assert res.plan.solver == "2d_uniform_matched"


def test_fill_holds_more_than_the_grid_plan_and_round_trips():
    t = small_table(4, seed=3, grid=GRID)
    ctx = 1000
    base = get_solver("2d_uniform").solve(t, _budget(t, ctx, 7.0), context_length=ctx)
    res = fill_keep(base, t)
    assert res.bytes_used > base.bytes_used  # 7x sits between the grid's keep ratios: the grid plan under-spends
    loaded = RoutingPlan.from_json(res.plan.to_json())
    assert loaded == res.plan
    assert loaded.grid.configs == (res.plan.layers[0],)


def test_interpolated_loss_matches_the_grid_and_lies_between():
    t = small_table(3, seed=1, grid=GRID)
    at = {k: interpolated_loss(t, LayerConfig(k, 8, 4)) for k in GRID.keep_ratios}
    for k, loss in at.items():
        col = t.grid.index(LayerConfig(k, 8, 4))
        assert loss == pytest.approx(float(t.loss[:, col].sum()), rel=1e-12)  # same floats, summed per layer
    mid = interpolated_loss(t, LayerConfig(0.175, 8, 4))
    assert mid == pytest.approx((at[0.1] + at[0.25]) / 2, rel=1e-9)  # 0.175 is halfway: linear in keep
    with pytest.raises(PlanError, match="K2/V4 is not in the table's grid"):
        interpolated_loss(t, LayerConfig(0.5, 2, 4))


def test_fill_refuses_a_plan_that_is_not_uniform():
    t = small_table(4, seed=0, grid=GRID)
    base = get_solver("greedy").solve(t, _budget(t, 800, 4.0), context_length=800)
    mixed = dataclasses.replace(base.plan, layers=(LayerConfig(0.5, 8, 8),) * 3 + (LayerConfig(1.0, 16, 16),))
    with pytest.raises(PlanError, match="needs a uniform plan"):
        fill_keep(dataclasses.replace(base, plan=mixed), t)


def test_largest_keep_names_a_budget_nothing_fits():
    t = small_table(4, seed=0, grid=GRID)
    with pytest.raises(PlanError, match="does not fit 10 bytes at 800 tokens"):
        largest_keep(t, LayerConfig(0.1, 4, 4), 10, 800)
