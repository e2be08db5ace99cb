"""The search space: per-layer neighbourhoods of the seed plans, repaired to the budget."""

from __future__ import annotations

import numpy as np
import optuna
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.search.space import Neighbourhood
from moend_fx.solvers.greedy import greedy_indices


def _arrays(seed: int, L: int = 5, C: int = 9):
    rng = np.random.default_rng(seed)
    B = rng.integers(10, 1000, size=(L, C)).astype(np.int64)
    S = rng.random((L, C)) * 3 + 0.01
    return S, B


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), radius=st.integers(0, 3), slack=st.floats(0.3, 0.9))
def test_candidates_hold_the_seeds_within_radius_and_proposals_fit(seed, radius, slack):
    S, B = _arrays(seed)
    budget = int(B.min(axis=1).sum() + slack * (B.max(axis=1).sum() - B.min(axis=1).sum()))
    g, _ = greedy_indices(S, B, budget)
    space = Neighbourhood.around([g], S, B, budget, radius)
    for l, cands in enumerate(space.candidates):
        assert int(g[l]) in cands
        assert len(cands) <= 2 * radius + 1
        p = space.pos_of[l, g[l]]
        assert all(abs(int(space.pos_of[l, c]) - int(p)) <= radius for c in cands)
    # any proposal, once repaired, fits the budget and is left alone if it already did
    rng = np.random.default_rng(seed + 1)
    idx = np.array([rng.choice(c) for c in space.candidates])
    fixed = space.repair(idx)
    assert space.bytes_of(fixed) <= budget
    assert np.array_equal(space.repair(g), g)


def test_radius_zero_is_the_seeds_only_and_params_round_trip():
    S, B = _arrays(3)
    budget = int(B.mean(axis=1).sum())
    g, _ = greedy_indices(S, B, budget)
    other = np.array([int(np.argmin(B[l])) for l in range(B.shape[0])])
    space = Neighbourhood.around([g, other], S, B, budget, 0)
    assert all(set(c) == {int(g[l]), int(other[l])} for l, c in enumerate(space.candidates))
    trial = optuna.trial.FixedTrial(space.params(g))
    assert np.array_equal(space.propose(trial), g)
    assert space.size == float(np.prod([len(c) for c in space.candidates]))
    assert space.key() != Neighbourhood.around([g], S, B, budget, 0).key()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), a=st.integers(0, 4), b=st.integers(0, 4), da=st.integers(-2, 2),
       db=st.integers(-2, 2))
def test_a_move_changes_at_most_two_layers_then_fits(seed, a, b, da, db):
    from moend_fx.search.space import Moves

    S, B = _arrays(seed)
    budget = int(B.mean(axis=1).sum())
    g, _ = greedy_indices(S, B, budget)
    space = Moves.around({"greedy": g}, S, B, budget, 2)
    assert np.array_equal(space.propose(optuna.trial.FixedTrial(space.seed_params("greedy", g))), g)
    idx = space.propose(optuna.trial.FixedTrial({"base": "greedy", "a": a, "da": da, "b": b, "db": db}))
    assert space.bytes_of(idx) <= budget
    moved = [l for l in range(len(g)) if idx[l] != g[l]]
    # at most the two moved layers change, unless the repair had to step layers down to fit
    if space.bytes_of(idx) == space.bytes_of(_moved(space, g, a, da, b, db)):
        assert set(moved) <= {a, b}
    for l in (a, b):
        assert int(idx[l]) in space.candidates[l] or space.pos_of[l, idx[l]] < space.pos_of[l, g[l]] - 2


def _moved(space, g, a, da, b, db):
    idx = np.array(g)
    C = space.B.shape[1]
    for l, d in ((a, da), (b, db)):
        idx[l] = space.ranks[l, int(np.clip(space.pos_of[l, idx[l]] + d, 0, C - 1))]
    return idx
