"""Confidence intervals: Wilson against scipy, bootstrap coverage and edge cases, formatting."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import binomtest

from moend_fx.common.errors import MoendError
from moend_fx.eval.stats import bootstrap_interval, format_ci, summarize, wilson_interval


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 500), frac=st.floats(0.0, 1.0))
def test_wilson_matches_scipy(n, frac):
    k = round(frac * n)
    lo, hi = wilson_interval(k, n)
    ref = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    # 1e-9: the same closed form, only float rounding differs.
    assert lo == pytest.approx(ref.low, abs=1e-9) and hi == pytest.approx(ref.high, abs=1e-9)
    assert 0.0 <= lo <= k / n <= hi <= 1.0


def test_wilson_known_value_and_ends():
    lo, hi = wilson_interval(25, 30)
    assert (round(100 * lo, 1), round(100 * hi, 1)) == (66.4, 92.7)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0
    assert wilson_interval(0, 10)[1] > 0.2  # not degenerate at k = 0, unlike the normal approximation


def test_bootstrap_brackets_the_mean_and_is_seeded():
    rng = np.random.default_rng(0)
    x = rng.uniform(0.2, 0.9, size=40)
    mean, lo, hi = bootstrap_interval(x)
    assert lo < mean < hi and mean == pytest.approx(x.mean())
    # Width close to the normal-theory 2 * 1.96 * sd / sqrt(n); 30% covers bootstrap noise at n=40.
    assert hi - lo == pytest.approx(2 * 1.96 * x.std(ddof=1) / np.sqrt(40), rel=0.3)
    assert bootstrap_interval(x, seed=1) == bootstrap_interval(x, seed=1)
    assert bootstrap_interval([0.5, 0.5, 0.5]) == (0.5, 0.5, 0.5)


def test_summarize_picks_the_method():
    s = summarize([1] * 25 + [0] * 5)
    assert s.method == "wilson" and str(s) == "83.3% [66.4, 92.7] (n=30)"
    f = summarize([1.0, 0.5, 0.0, 1.0, 2 / 3])
    assert f.method == "bootstrap" and f.low <= f.mean <= f.high and f.n == 5
    assert set(f.to_dict()) == {"mean", "low", "high", "n", "method"}


def test_format_ci():
    assert format_ci(0.833333, 0.653, 0.927, 30) == "83.3% [65.3, 92.7] (n=30)"


def test_bad_input_raises():
    with pytest.raises(MoendError, match="n=0"):
        wilson_interval(0, 0)
    with pytest.raises(MoendError, match="allowed: 0..3"):
        wilson_interval(4, 3)
    with pytest.raises(MoendError, match="empty"):
        summarize([])
    with pytest.raises(MoendError, match="empty"):
        bootstrap_interval([])
    with pytest.raises(MoendError, match="out of range"):
        summarize([0.5, 1.5])
    with pytest.raises(MoendError, match="level"):
        bootstrap_interval([0.5], level=1.0)
