"""The keep-ratio envelope of S: monotone, never lower than measured, unchanged when already in order."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.calibration.monotone import monotone_in_keep
from moend_fx.plan.routing import Grid

GRID = Grid((0.1, 0.5, 1.0), (16, 4), (16, 4))


def _column(grid: Grid, keep: float, kb: int, vb: int) -> int:
    return next(i for i, c in enumerate(grid.configs) if (c.keep_ratio, c.k_bits, c.v_bits) == (keep, kb, vb))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), layers=st.integers(1, 4))
def test_the_envelope_is_monotone_and_never_lowers(seed, layers):
    S = np.random.default_rng(seed).uniform(0.01, 1.0, (layers, len(GRID)))
    out, facts = monotone_in_keep(S, GRID)
    assert (out >= S).all()
    for kb in GRID.k_bits:
        for vb in GRID.v_bits:
            cols = [_column(GRID, k, kb, vb) for k in sorted(GRID.keep_ratios)]  # keep ascending
            assert (np.diff(out[:, cols], axis=1) <= 0).all()  # fewer tokens kept: never a smaller error
    assert facts["adjusted"] == int((out > S).sum())
    assert facts["max_raise"] == float((out - S).max())


def test_an_ordered_table_is_unchanged_and_a_dip_is_raised_to_its_neighbour():
    S = np.zeros((1, len(GRID)))
    for i, c in enumerate(GRID.configs):
        S[0, i] = (1.0 - c.keep_ratio) + (16 - c.k_bits) * 0.01 + (16 - c.v_bits) * 0.001
    out, facts = monotone_in_keep(S, GRID)
    assert np.array_equal(out, S) and facts["adjusted"] == 0
    dip = S.copy()
    dip[0, _column(GRID, 0.5, 4, 4)] = S[0, _column(GRID, 1.0, 4, 4)] - 0.05  # keep 0.5 "better" than 1.0
    out, facts = monotone_in_keep(dip, GRID)
    assert out[0, _column(GRID, 0.5, 4, 4)] == S[0, _column(GRID, 1.0, 4, 4)]
    assert facts["adjusted"] == 1
