"""The memory model's part for eviction state: the bytes a cache layer keeps to decide what to evict.

An evicting layer keeps its rows' RoPE offsets ([B] int64), whatever its scorer holds (trig: the layer's
calibrated query statistics) and, for a scorer that reads queries (snapkv, h2o, trig without statistics), a
window of the last queries (``moend_fx.eviction.query_window``). A layer that keeps every token keeps none of it.
Each scorer class says what it holds (``Scorer.state_bytes``, ``Scorer.reads_queries``), so this module only adds
them up; ``MoENDLayer.state_nbytes()`` measures the same bytes.
"""

from __future__ import annotations

from moend_fx.common.defaults import QUERY_WINDOW
from moend_fx.plan.config import LayerConfig

OFFSET_BYTES = 8  # one int64 RoPE offset per batch row


def scorer_state_bytes(config: LayerConfig, tokens: int, *, scorer: str | None, num_heads: int, head_dim: int,
                       batch: int = 1, window: int = QUERY_WINDOW, calibrated: bool = True,
                       evicts: bool | None = None, queries: int | None = None) -> int:
    """Eviction-state bytes of one layer with ``config`` after ``tokens`` queries.

    scorer: the scorer name (None or a non-evicting config: 0); num_heads: query heads; calibrated: the layer has
    calibrated query statistics (``prepare(model, plan, table=...)`` with a table that has them); evicts: whether the
    layer evicts (default ``config.evicts``; True also for a keep-1.0 layer that has started evicting); queries: how
    many queries its window has seen (default ``tokens``; fewer for a layer that started evicting late)."""
    if scorer is None or not (config.evicts if evicts is None else evicts) or tokens <= 0:
        return 0
    # imported here: the eviction stage builds on the plan stage, not the other way round
    from moend_fx.eviction.query_window import QueryWindow
    from moend_fx.eviction.scorers import SCORERS

    cls = SCORERS[scorer]
    total = OFFSET_BYTES * batch + cls.state_bytes(num_heads=num_heads, head_dim=head_dim, calibrated=calibrated)
    if cls.reads_queries(calibrated=calibrated):
        total += QueryWindow.bytes_for(batch=batch, num_heads=num_heads, head_dim=head_dim,
                                       seen=tokens if queries is None else queries, size=window)
    return total
