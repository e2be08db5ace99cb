"""Narrow keys at low keep ratios as a last resort (moend_fx/solvers/last_resort.py), applied by every solver."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.calibration.tables import load_table
from moend_fx.common.errors import BudgetError, MoendError
from moend_fx.plan.routing import Grid
from moend_fx.solvers import SOLVERS, get_solver
from moend_fx.solvers.base import plan_loss
from moend_fx.solvers.last_resort import (
    NARROW_K_MAX_CONTEXT,
    NARROW_K_MIN_KEEP,
    last_resort_columns,
    rule_min_keep,
    with_surcharge,
)
from tests.solvers.helpers import small_table

CTX = 512
RTOL = 1e-9  # sums of the same floats, in another order at most


def test_the_columns_are_narrow_keys_below_the_keep_ratio():
    g = Grid(k_bits=(16, 8, 4, 2))
    marked = {c for c, m in zip(g.configs, last_resort_columns(g, 0.5)) if m}
    assert marked == {c for c in g.configs if c.k_bits <= 4 and c.keep_ratio < 0.5}
    assert len(marked) == 2 * 2 * 3  # keeps 0.1 and 0.25, K4 and K2, three V widths (the paper's)
    assert not last_resort_columns(g, 0.0).any()
    assert last_resort_columns(Grid(), 1.0).sum() == 5 * 3  # every keep below 1 at K4, three V widths


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 6))
def test_the_surcharge_outweighs_any_difference_between_plans(seed, layers):
    rng = np.random.default_rng(seed)
    S = rng.uniform(0.0, 2.0, size=(layers, 7))
    cols = rng.random(7) < 0.5
    out = with_surcharge(S, cols)
    if not cols.any() or cols.all():  # nothing to prefer: S as it is
        assert out is S
        return
    spread = (S.max(1) - S.min(1)).sum()
    assert np.all(out[:, ~cols] == S[:, ~cols])
    assert np.all(out[:, cols] - S[:, cols] > spread)  # one more last-resort layer always costs more


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 1000), st.floats(1.0, 6.0))
def test_exact_takes_the_fewest_last_resort_layers_then_the_least_loss(seed, ratio):
    t = small_table(3, seed=seed)  # keeps 0.25 / 0.5 / 1 x K16 / K4 x V16 / V4: K4 at 0.25 is the last resort
    B, S = t.bytes_matrix(CTX), t.loss
    budget = int(B.max(1).sum() / ratio)
    lr = last_resort_columns(t.grid, NARROW_K_MIN_KEEP)
    rows = np.arange(3)
    fits = [(int(lr[list(idx)].sum()), float(S[rows, idx].sum()))
            for idx in itertools.product(range(len(t.grid)), repeat=3) if B[rows, idx].sum() <= budget]
    if not fits:
        with pytest.raises(BudgetError):
            get_solver("exact").solve(t, budget, context_length=CTX)
        return
    want = min(fits)
    res = get_solver("exact").solve(t, budget, context_length=CTX)
    assert res.info["last_resort_layers"] == want[0]
    assert res.predicted_loss == pytest.approx(want[1], rel=RTOL)


@pytest.mark.parametrize("name", sorted(set(SOLVERS) - {"optuna"}))
def test_every_solver_reports_the_tables_own_loss_and_counts_last_resort_layers(name):
    t = load_table("synthetic:12:3")
    res = get_solver(name).solve(t, "6x", context_length=2048)
    assert res.predicted_loss == pytest.approx(plan_loss(t.loss, res.indices), rel=RTOL)  # not the surcharged one
    lr = last_resort_columns(t.grid, NARROW_K_MIN_KEEP)
    assert res.info["last_resort_layers"] == int(lr[list(res.indices)].sum())


def test_the_rule_changes_the_paper_grid_plans_and_zero_turns_it_off():
    t = load_table("synthetic:30:0")
    on = get_solver("greedy").solve(t, "14x", context_length=2048)
    off = get_solver("greedy", narrow_k_min_keep=0).solve(t, "14x", context_length=2048)
    narrow_low = lambda plan: sum(c.k_bits <= 4 and c.keep_ratio < 0.5 for c in plan.layers)  # noqa: E731
    assert narrow_low(off.plan) > 0  # else this tests nothing
    assert narrow_low(on.plan) == on.info["last_resort_layers"] == 0
    assert off.info["last_resort_layers"] == 0  # the rule is off: nothing counts as a last resort
    assert on.bytes_used <= on.budget.bytes and on.predicted_loss >= off.predicted_loss


def test_a_tight_budget_still_gets_a_plan_from_last_resort_configs():
    t = load_table("synthetic:30:0")
    B = t.bytes_matrix(2048)
    lr = last_resort_columns(t.grid, NARROW_K_MIN_KEEP)
    without = int(B[:, ~lr].min(1).sum())  # the least bytes of a plan with no last-resort layer
    res = get_solver("exact").solve(t, without - 1, context_length=2048)
    assert res.info["last_resort_layers"] >= 1 and res.bytes_used <= without - 1
    assert get_solver("exact").solve(t, without, context_length=2048).info["last_resort_layers"] == 0


@pytest.mark.parametrize("bad", [-0.1, 1.5, "half", True, float("nan")])
def test_a_bad_min_keep_is_a_clear_error(bad):
    t = load_table("synthetic:4:0")
    with pytest.raises(MoendError, match=r"narrow_k_min_keep=.*allowed: a number in \[0, 1\]"):
        get_solver("greedy", narrow_k_min_keep=bad).solve(t, "4x", context_length=512)


@pytest.mark.parametrize("name", ["greedy", "exact", "2d", "2d_uniform"])  # those the 16x budget leaves feasible
def test_the_rule_covers_contexts_up_to_its_max_context_only(name):
    t = load_table("synthetic:30:0")
    cases = [(4096, "16x", NARROW_K_MAX_CONTEXT, True), (4097, "16x", NARROW_K_MAX_CONTEXT, False),
             (8192, "18x", 0, True), (4096, "16x", 2048, False)]
    for ctx, budget, limit, applies in cases:
        rule = get_solver(name, narrow_k_max_context=limit).solve(t, budget, context_length=ctx)
        off = get_solver(name, narrow_k_min_keep=0).solve(t, budget, context_length=ctx)
        every = get_solver(name, narrow_k_max_context=0).solve(t, budget, context_length=ctx)
        assert rule.plan.layers == (every if applies else off).plan.layers, (ctx, limit)
        if name != "2d_uniform":  # its 16x plan has no narrow key with or without the rule: nothing to tell apart
            assert every.plan.layers != off.plan.layers, (ctx, budget)  # else this case tests nothing


def test_rule_min_keep_is_the_min_keep_up_to_the_max_context():
    assert rule_min_keep(0.5, 4096, 4096) == 0.5
    assert rule_min_keep(0.5, 4096, 7900) == 0.0
    assert rule_min_keep(0.25, 0, 10**6) == 0.25


@pytest.mark.parametrize("bad", [-1, 1.5, "4k", True, None])
def test_a_bad_max_context_is_a_clear_error(bad):
    t = load_table("synthetic:4:0")
    with pytest.raises(MoendError, match=r"narrow_k_max_context=.*allowed: an int >= 0"):
        get_solver("greedy", narrow_k_max_context=bad).solve(t, "4x", context_length=512)
