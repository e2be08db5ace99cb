"""SnapKV: attention of an observation window of recent queries over all keys, pooled."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from moend_fx.common.checks import check_choice, check_int
from moend_fx.common.options import HeadReduce, Pooling, ScorerName, Setting
from moend_fx.eviction.query_stats import QueryStats
from moend_fx.eviction.rope import RopeSpec
from moend_fx.eviction.scorers.base import Scorer, Tensor
from moend_fx.eviction.scorers.h2o import check_attention_options, column_sums
from moend_fx.eviction.scorers.pooling import check_pooling, pool_scores


@dataclass(frozen=True)
class SnapKVScorer(Scorer):
    """SnapKV: attention of the observation window over all keys, summed over the window, pooled.

    softmax(q k^T * scale) with scale = 1/sqrt(D) by default, causal by position (a key is visible to a
    window query iff key_position <= query_position; no query_positions = all visible), summed over the
    last ``window`` given queries (None = all), ``pooling`` ("avg", "max" or "none") with ``kernel_size`` along the
    stored tokens, then folded over the query heads of each KV group by ``head_reduce``: their mean (default, as
    SnapKV does for grouped-query attention) or their max (a key one head of the group attends to sharply keeps
    its full score instead of a ``1/group`` share of it).
    """

    name: ClassVar[str] = ScorerName.SNAPKV
    setting: ClassVar[str] = Setting.QUERY_AWARE
    window: int | None = None
    kernel_size: int = 5
    pooling: Pooling = Pooling.AVG
    scale: float | None = None
    chunk: int = 256
    head_reduce: HeadReduce = HeadReduce.MEAN

    def __post_init__(self) -> None:
        object.__setattr__(self, "head_reduce", check_choice(f"{self.name} head_reduce", self.head_reduce, HeadReduce))
        if self.window is not None:
            check_int(f"{self.name} window", self.window)
        object.__setattr__(self, "pooling", check_pooling(self.name, self.pooling, self.kernel_size))
        check_attention_options(self.name, self.scale, self.chunk)

    @classmethod
    def layer_options(cls, *, rope: RopeSpec | None, stats: QueryStats | None, query_window: int) -> dict[str, Any]:
        """The observation window is the layer's query window."""
        return {"window": query_window}

    def score(self, keys: Tensor, values: Tensor, *, queries: Tensor | None = None, key_positions: Tensor,
              query_positions: Tensor | None = None) -> Tensor:
        """keys, values: [B, Hkv, T, D]; queries: [B, H, W, D]; key_positions: [B, Hkv, T]; query_positions:
        [B, W] or None. Returns [B, Hkv, T]."""
        att = column_sums(self.name, self.scale, self.chunk, keys, values, queries, key_positions, query_positions,
                          self.window)
        pooled = pool_scores(att, self.kernel_size, self.pooling)  # [B, Hkv, G, T]
        if self.head_reduce == HeadReduce.MAX:
            return pooled.amax(dim=2)
        return pooled.mean(dim=2)
