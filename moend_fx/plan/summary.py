"""One-line descriptions of a routing plan, for the CLI, benchmarks and reports."""

from __future__ import annotations

from collections import Counter

from moend_fx.plan.routing import RoutingPlan


def plan_summary(plan: RoutingPlan) -> str:
    """``"18x keep 0.25/K4/V4, 12x keep 1/K8/V8"``: how many layers use each config, most used first (ties in
    the order the configs first appear)."""
    counts = Counter(plan.layers)
    parts = sorted(counts.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{n}x keep {c.keep_ratio:g}/K{c.k_bits}/V{c.v_bits}" for c, n in parts)
