"""The calibrated query statistics as the flat arrays a sensitivity table stores, and their checks on load."""

from __future__ import annotations

from typing import Any

import numpy as np

from moend_fx.common.errors import TableError
from moend_fx.plan.routing import ModelFingerprint

__all__ = ["STATS_PREFIX", "stats_to_arrays"]

STATS_PREFIX = "query_stats."


def _stats_key(layer: int, part: str) -> str:
    return f"{STATS_PREFIX}layers.{layer}.{part}"


def _check_stats(stats: dict[str, np.ndarray], fp: ModelFingerprint, where: str) -> None:
    """Query-stat tensors, if any, must cover every layer with [num_heads, head_dim/2(, 2)] shapes."""
    if not stats:
        return
    f = fp.head_dim // 2
    for l in range(fp.num_layers):
        shapes = {"sum": (fp.num_heads, f, 2), "abs_sum": (fp.num_heads, f), "count": (1,)}
        for part, shape in shapes.items():
            k = _stats_key(l, part)
            if k not in stats:
                raise TableError(f"{where}: query statistics miss {k!r} (every layer needs sum, abs_sum, count)")
            if tuple(stats[k].shape) != shape:
                raise TableError(f"{where}: {k} has shape {tuple(stats[k].shape)}; the model "
                                 f"(num_heads={fp.num_heads}, head_dim={fp.head_dim}) needs {shape}")
    extra = set(stats) - {_stats_key(l, p) for l in range(fp.num_layers) for p in ("sum", "abs_sum", "count")}
    if extra:
        raise TableError(f"{where}: unexpected tensor(s) {sorted(extra)[:5]}")


def stats_to_arrays(stats: dict[int, Any]) -> dict[str, np.ndarray]:
    """{layer: QueryStats} -> the flat arrays a table stores (count as [1] int64)."""
    out: dict[str, np.ndarray] = {}
    for l, st in sorted(stats.items()):
        for k, t in st.to_tensors(prefix=_stats_key(l, "")).items():
            out[k] = t.reshape(1).numpy() if k.endswith("count") else t.numpy()
    return out
