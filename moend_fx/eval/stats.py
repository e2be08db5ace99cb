"""Confidence intervals for task accuracies: Wilson for 0/1 outcomes, bootstrap for fractional scores.

With 30 examples a 0/1 accuracy of 83% has a 95% interval about 27 points wide, so tables must
show the interval and the sample size next to every figure (issue 5 asks for both).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moend_fx.common.checks import check_int
from moend_fx.common.errors import MoendError

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for k successes out of n trials, as fractions in [0, 1].

    Unlike the normal approximation it stays inside [0, 1] and is not degenerate at k = 0 or n.
    """
    check_int("n", n)
    if not 0 <= k <= n:
        raise MoendError(f"k {k} out of range; allowed: 0..{n}")
    p = k / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1.0 - p) / n + z * z / (4 * n * n)) / denom
    # At k = 0 (k = n) the bound is exactly 0 (1); the formula gives it only up to rounding.
    lo = 0.0 if k == 0 else max(0.0, centre - half)
    hi = 1.0 if k == n else min(1.0, centre + half)
    return lo, hi


def bootstrap_interval(
    scores: Sequence[float], level: float = 0.95, n_boot: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap interval of the mean of `scores` (each in [0, 1])."""
    x = np.asarray(list(scores), dtype=np.float64)
    if x.size < 1:
        raise MoendError("scores is empty; need at least one score")
    if not 0.0 < level < 1.0:
        raise MoendError(f"level {level} out of range; allowed: (0, 1)")
    check_int("n_boot", n_boot)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return float(x.mean()), float(lo), float(hi)


@dataclass(frozen=True)
class Summary:
    """A mean score with its 95% interval. method: "wilson" (0/1 scores) or "bootstrap"."""

    mean: float
    low: float
    high: float
    n: int
    method: str

    def __str__(self) -> str:
        return format_ci(self.mean, self.low, self.high, self.n)

    def to_dict(self) -> dict:
        return {"mean": self.mean, "low": self.low, "high": self.high, "n": self.n, "method": self.method}


def summarize(scores: Sequence[float], seed: int = 0) -> Summary:
    """Mean of `scores` with a 95% interval: Wilson when every score is 0 or 1, else bootstrap."""
    xs = [float(s) for s in scores]
    if not xs:
        raise MoendError("scores is empty; need at least one score")
    bad = [s for s in xs if not 0.0 <= s <= 1.0]
    if bad:
        raise MoendError(f"score {bad[0]} out of range; allowed: [0, 1]")
    if all(s in (0.0, 1.0) for s in xs):
        k = int(sum(xs))
        lo, hi = wilson_interval(k, len(xs))
        return Summary(k / len(xs), lo, hi, len(xs), "wilson")
    mean, lo, hi = bootstrap_interval(xs, seed=seed)
    return Summary(mean, lo, hi, len(xs), "bootstrap")


def format_ci(mean: float, low: float, high: float, n: int) -> str:
    """"83.3% [66.4, 92.7] (n=30)" from fractions in [0, 1]."""
    return f"{100 * mean:.1f}% [{100 * low:.1f}, {100 * high:.1f}] (n={n})"
