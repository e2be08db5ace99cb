import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.plan.routing import Grid, LayerConfig
from moend_fx.solvers.synthetic import synthetic_table


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 40), st.integers(0, 10_000))
def test_paper_shape(layers, seed):
    t = synthetic_table(layers, seed=seed)
    g = t.grid
    S = t.S
    assert S.shape == (layers, len(g)) and np.all(S >= 0)
    where = {c: i for i, c in enumerate(g.configs)}
    col = lambda k, kb, vb: S[:, where[LayerConfig(k, kb, vb)]]  # noqa: E731
    assert np.all(col(1.0, 16, 16) == 0)
    # Monotone: less keep or fewer bits never lowers S.
    for kb in (16, 8, 4):
        for vb in (16, 8, 4):
            for a, b in zip(g.keep_ratios, g.keep_ratios[1:]):
                assert np.all(col(a, kb, vb) >= col(b, kb, vb))
    assert np.all(col(1.0, 4, 16) > col(1.0, 8, 16)) and np.all(col(1.0, 16, 4) > col(1.0, 16, 8))
    # Spreads (max/min across layers): eviction hundreds x, K bits moderate, V bits small.
    spread = lambda c: c.max() / c.min()  # noqa: E731
    assert spread(col(0.1, 16, 16)) > 100
    assert spread(col(1.0, 16, 8)) < 2 and spread(col(1.0, 16, 4)) < 2
    assert spread(col(1.0, 8, 16)) > 10


def test_seed_reproducible_and_custom_grid():
    a, b = synthetic_table(5, seed=3), synthetic_table(5, seed=3)
    assert np.array_equal(a.S, b.S)
    t = synthetic_table(3, grid=Grid((0.5, 1.0), (16, 2), (16, 2)))
    assert t.S.shape == (3, 8) and t.calibration["synthetic"] is True
