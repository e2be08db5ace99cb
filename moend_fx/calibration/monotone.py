"""S made monotone in keep ratio: keeping fewer tokens of a layer at the same bit widths never costs less.

Measured S breaks this order by noise: the kept token counts of two keep ratios leave different 16-bit K
residual windows (at T = 2048, keep 0.9 leaves 20 residual tokens and keep 1.0 none), and one calibration window
of queries is a small sample. A solver would then buy "keep 0.9" as if it were better than keeping everything.
The envelope below raises each entry to the largest S of the same (K bits, V bits) at any larger keep ratio:
the smallest change that restores the order without lowering any measurement.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moend_fx.plan.routing import Grid


def monotone_in_keep(S: np.ndarray, grid: Grid) -> tuple[np.ndarray, dict[str, Any]]:
    """(S' [L, C], facts): S [L, C] with every column raised to the running maximum over larger keep ratios of
    the same bit pair, and how much that changed (``adjusted`` entries, ``max_raise`` and ``max_relative_raise``
    of any entry)."""
    out = np.array(S, dtype=np.float64, copy=True)
    index = {c: i for i, c in enumerate(grid.configs)}
    for kb in grid.k_bits:
        for vb in grid.v_bits:
            cols = [index[c] for c in sorted((c for c in grid.configs if (c.k_bits, c.v_bits) == (kb, vb)),
                                             key=lambda c: -c.keep_ratio)]
            out[:, cols] = np.maximum.accumulate(out[:, cols], axis=1)
    raise_ = out - np.asarray(S, dtype=np.float64)
    rel = np.divide(raise_, out, out=np.zeros_like(raise_), where=out > 0)
    return out, {"adjusted": int((raise_ > 0).sum()), "max_raise": float(raise_.max(initial=0.0)),
                 "max_relative_raise": float(rel.max(initial=0.0))}
