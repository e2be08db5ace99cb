"""The properties every registered solver shares (docs/extending.md): on any table and budget, a plan is never
over budget and never predicts less loss than the exact optimum; a budget below what any plan needs is a
:class:`BudgetError` that names the minimum. Each entry of ``SOLVERS`` runs, with fast options where the
defaults are slow (Optuna: a few trials, in-memory storage)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.common.errors import BudgetError
from moend_fx.solvers import SOLVERS, get_solver
from moend_fx.solvers.base import plan_bytes_of, plan_loss
from tests.solvers.helpers import small_table

CTX = 512
RTOL = 1e-9  # two sums of the same floats, maybe in another order
FAST_OPTIONS: dict[str, dict] = {"optuna": {"n_trials": 8, "storage": ":memory:"}}


def fast_solver(name: str):
    return get_solver(name, **FAST_OPTIONS.get(name, {}))


def test_every_registered_solver_has_fast_settings_or_needs_none():
    # A new slow solver must add its fast options here, or these property tests become the slow ones.
    assert set(FAST_OPTIONS) <= set(SOLVERS)
    for name in SOLVERS:
        fast_solver(name)


@pytest.mark.parametrize("name", sorted(SOLVERS))
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), layers=st.integers(1, 5), where=st.floats(0.0, 1.0))
def test_plan_fits_and_is_no_better_than_exact(name, seed, layers, where):
    t = small_table(layers, seed=seed)
    B = t.bytes_matrix(CTX)
    lo, hi = int(B.min(axis=1).sum()), int(B.max(axis=1).sum())
    budget = lo + int(where * (hi - lo))  # from the least any plan needs to the whole lossless cache
    try:
        res = fast_solver(name).solve(t, budget, context_length=CTX)
    except BudgetError as e:  # a structured family may not fit where per-layer routing does
        assert "minimum feasible budget" in str(e)
        return
    assert res.bytes_used == plan_bytes_of(B, res.indices) <= budget
    assert res.plan.bytes_planned == res.bytes_used and res.plan.budget_bytes == budget
    assert res.predicted_loss == plan_loss(t.S, res.indices) == res.plan.predicted_loss
    assert [t.grid.index(c) for c in res.plan.layers] == list(res.indices)
    optimum = get_solver("exact").solve(t, budget, context_length=CTX).predicted_loss
    assert res.predicted_loss >= optimum - RTOL * max(1.0, abs(optimum))


@pytest.mark.parametrize("name", sorted(SOLVERS))
@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 10_000), layers=st.integers(1, 5), short=st.integers(1, 1000))
def test_budget_below_every_plan_is_a_budget_error(name, seed, layers, short):
    t = small_table(layers, seed=seed)
    minimum = int(t.bytes_matrix(CTX).min(axis=1).sum())
    with pytest.raises(BudgetError, match="minimum feasible budget"):
        fast_solver(name).solve(t, max(1, minimum - short), context_length=CTX)
