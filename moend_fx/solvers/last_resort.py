"""Narrow keys at low keep ratios are a last resort on contexts up to 4k tokens: the rule every solver applies before
it searches.

A layer that keeps 10-25% of the prompt keeps the facts it will be asked for, and a retrieval is one of them
winning a sharp softmax, which a 4-bit key moves. The table's S (the relative L2 error of the window's attention
output) is dominated there by eviction's blurred averages and adds the two errors in quadrature, so it prices a
4-bit key after eviction at almost nothing (a median 0.002 on an S of 0.69 at keep 0.1). Screened on retrieval,
plans that avoid them answer 12 examples better and 3 worse over 9 screens with fewer bytes (docs/results.md,
"Pricing 4-bit keys"). They stay in the grid, so a budget that no other plan fits still has one. The trade,
measured: the published evaluation gains at 2k-4k and loses at 8k, and on plain held-out text the greedy plans'
continuation KL is 1.13-3.7x higher at 4x-16x (docs/results.md, "Narrow keys as a last resort"). So the rule
covers plans for contexts of at most :data:`NARROW_K_MAX_CONTEXT` tokens: at 8k it moved no needles measurably (3
examples better, 7 worse over 140 paired, 60 of them held out) and cost 20-33% more continuation KL (docs/results.md,
"The last-resort rule at 8k and on plain text"). On every layer that evicts (``narrow_k_min_keep=1``) it was screened
and not adopted: it wins passkeys and cuts the last digit off six-digit needles, 8 examples better and 9 worse
over 480 paired at 2k-4k (docs/results.md, "Narrow keys on every evicting layer"). Pass
``narrow_k_min_keep=0`` for the plans that minimise the table's predicted loss at every length, or
``narrow_k_max_context=0`` for the rule at every length.
"""

from __future__ import annotations

import numpy as np

from moend_fx.common.errors import MoendError
from moend_fx.plan.grid import Grid

NARROW_K_BITS = 4
"""K widths at or below this are *narrow*."""
NARROW_K_MIN_KEEP = 0.5
"""The default rule: narrow keys are a last resort on layers that keep fewer than half their tokens."""
NARROW_K_MAX_CONTEXT = 4096
"""The default rule covers plans for contexts of at most this many tokens (the longest it was measured to help)."""


def check_min_keep(value: object) -> float:
    """``value`` as a float if it is a number in [0, 1] (0: no rule), else :class:`MoendError`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise MoendError(f"narrow_k_min_keep={value!r} is not allowed; allowed: a number in [0, 1] "
                         "(0 = narrow keys at any keep ratio)")
    return float(value)


def check_max_context(value: object) -> int:
    """``value`` if it is an int >= 0 (0: the rule at every context length), else :class:`MoendError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MoendError(f"narrow_k_max_context={value!r} is not allowed; allowed: an int >= 0 (tokens; 0 = the "
                         "rule at every context length)")
    return value


def rule_min_keep(min_keep: object, max_context: object, context_length: int) -> float:
    """The keep ratio below which narrow keys are a last resort for a plan of ``context_length`` tokens:
    ``min_keep`` when ``context_length <= max_context`` (or ``max_context`` is 0), else 0 (no rule)."""
    keep, limit = check_min_keep(min_keep), check_max_context(max_context)
    return keep if limit == 0 or context_length <= limit else 0.0


def last_resort_columns(grid: Grid, min_keep: float) -> np.ndarray:
    """[C] bool: the grid's configs with K bits <= :data:`NARROW_K_BITS` at a keep ratio below ``min_keep``."""
    return np.array([c.k_bits <= NARROW_K_BITS and c.keep_ratio < min_keep for c in grid.configs], dtype=bool)


def with_surcharge(S: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """S [L, C] with ``columns`` [C] (bool) raised by more than any plan can gain elsewhere, so that a plan
    minimising the sum uses as few of them as fit (exactly so for an exact solver), then the least loss:
    the surcharge is 1 + sum over layers of (max - min) S."""
    if not columns.any() or columns.all():
        return S
    surcharge = 1.0 + float((S.max(axis=1) - S.min(axis=1)).sum())
    return S + surcharge * columns[None, :]
