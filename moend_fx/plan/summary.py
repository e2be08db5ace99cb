"""One-line descriptions of a routing plan and the columns of its bytes-by-part tables, for the CLI, benchmarks
and reports."""

from __future__ import annotations

from collections import Counter

from moend_fx.plan.memory import PARTS
from moend_fx.plan.routing import RoutingPlan


def plan_summary(plan: RoutingPlan) -> str:
    """``"18x keep 0.25/K4/V4, 12x keep 1/K8/V8"``: how many layers use each config, most used first (ties in
    the order the configs first appear)."""
    counts = Counter(plan.layers)
    parts = sorted(counts.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{n}x keep {c.keep_ratio:g}/K{c.k_bits}/V{c.v_bits}" for c, n in parts)


# -- bytes by part (moend_fx.plan.memory.plan_layer_parts), as the CLI's tables print them ------------------------

PART_LABELS: dict[str, str] = dict(zip(PARTS, ("K codes", "V codes", "scales", "residual", "positions", "scorer"),
                                       strict=True))
"""Column heading of each part of :data:`~moend_fx.plan.memory.PARTS`, in that order."""
PART_WIDTH = 9  # digits of a byte column: up to 999,999,999 B a cell


def parts_header(width: int = PART_WIDTH) -> str:
    """The byte columns' headings: one per part, then ``total``."""
    return " ".join(f"{h:>{width}}" for h in (*PART_LABELS.values(), "total"))


def parts_cells(parts: dict[str, int], width: int = PART_WIDTH) -> str:
    """One row's byte columns: each part (in :data:`PART_LABELS` order), then their sum."""
    vals = [parts[k] for k in PART_LABELS]
    return " ".join(f"{v:>{width}}" for v in (*vals, sum(vals)))


def parts_shares(parts: dict[str, int], width: int = PART_WIDTH) -> str:
    """Each part's share of the total (``"12.3%"``), aligned under :func:`parts_cells`."""
    total = sum(parts[k] for k in PART_LABELS)
    shares = [100.0 * parts[k] / total if total else 0.0 for k in PART_LABELS]
    return " ".join(f"{s:>{width - 1}.1f}%" for s in (*shares, 100.0 if total else 0.0))


def sum_parts(rows: list[dict[str, int]]) -> dict[str, int]:
    """Part-wise sum of several layers' parts."""
    return {k: sum(r[k] for r in rows) for k in PART_LABELS}
