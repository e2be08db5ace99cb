"""The query-aware scorer: SnapKV over the prompt's last queries, trig once no query is known."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from moend_fx.common.checks import check_choice
from moend_fx.common.errors import MoendError
from moend_fx.common.options import HeadReduce, ScoreCombine, ScorerName, Setting
from moend_fx.eviction.query_stats import QueryStats
from moend_fx.eviction.rope import RopeSpec
from moend_fx.eviction.scorers.base import Scorer, Tensor
from moend_fx.eviction.scorers.snapkv import SnapKVScorer
from moend_fx.eviction.scorers.trig import TrigScorer, standardise


@dataclass(frozen=True)
class SnapKVTrigScorer(Scorer):
    """SnapKV where the prompt's last queries are known, the calibrated trig score where they are not.

    A prompt that ends with its question (the query-aware setting) is compressed by what those queries attend
    to: the observation window of SnapKV, max-pooled over ``kernel_size`` stored neighbours (a fact is a span),
    plus ``trig_weight`` (default 1) times the trig score, both standardised over the tokens of each (row, KV
    head). Once the prompt is compressed its queries are dropped: a decode-time re-eviction scores with trig on the
    calibrated ``stats`` alone, so the layer keeps no query window while it decodes (a window of 32 queries
    is about a third of a layer's bytes at 14x on SmolLM2; the plan budgets the steady state).

    Why the sum (SmolLM2-135M, a 2k passkey prompt, query-aware, the greedy 14x plan): the question's queries
    alone kept the whole needle in 10 of 30 layers and the answer lost two digits; trig alone kept it in 20,
    the sum in 21 (trig_weight 0.5: 22; 2 and 4: 21), and both answered. The evaluation in docs/results.md is
    the real test.

    ``value_weight`` is the trig score's value-norm weight (:class:`TrigScorer`), so the prompt and every
    decode-time re-eviction weigh values alike. Query-aware niah_single at 2k, 14x, the plan fixed: 86.7% with
    weight 0, 90.0% with 1 (2 examples better, 1 worse: inside the interval; the gain is query-agnostic's).

    ``diversity_weight`` is the trig score's key-novelty weight (:class:`TrigScorer`), 0.5 as in trig. The
    question's queries alone do not find the fact at high compression: SmolLM2-135M, query-aware, the greedy plan
    fixed, weight 0 / 0.5 / 1: niah_single at 8k, 14x, 70 / 85 / 85% (20 examples); at 2k, 20x, 36.7 / 93.3 / 96.7%
    (30) (docs/results.md, "Key novelty in the query-aware scorer").

    ``head_reduce`` folds the query heads of a KV group in the SnapKV part (:class:`SnapKVScorer`; default their
    mean). ``combine`` joins the two standardised scores: ``sum`` (default) or ``max``, which keeps a token that
    either ranks high (the question's pick even where trig rates it low). Neither alternative is the default:
    query-aware niah_single at 8k on SmolLM2, the max over heads answered the evaluation's 20 examples at 14x and
    20x (the table re-calibrated with it) exactly as the mean did, and 1 of 20 held-out ones better at 20x;
    ``combine="max"`` answered 1 of those 20 better and 2 worse (docs/results.md, "The query heads of a KV group in
    the query-aware scorer").

    Without calibrated statistics (a keep-1.0 layer that starts evicting late, or no table) the layer keeps
    its window and this is SnapKV over it, at every re-eviction.
    """

    name: ClassVar[str] = ScorerName.SNAPKV_TRIG
    setting: ClassVar[str] = Setting.QUERY_AWARE
    rope: RopeSpec | None = None
    stats: QueryStats | None = field(default=None, compare=False, repr=False)
    window: int | None = None
    kernel_size: int = 9
    trig_weight: float = 1.0
    value_weight: float = TrigScorer.value_weight  # trig's own defaults, so the two scorers weigh alike
    diversity_weight: float = TrigScorer.diversity_weight
    head_reduce: HeadReduce = HeadReduce.MEAN
    combine: ScoreCombine = ScoreCombine.SUM
    _snap: SnapKVScorer = field(init=False, compare=False, repr=False)
    _trig: TrigScorer | None = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("trig_weight", "value_weight", "diversity_weight"):
            w = getattr(self, name)
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not (math.isfinite(w) and w >= 0):
                raise MoendError(f"{self.name} {name}={w!r}; must be a finite number >= 0")
        object.__setattr__(self, "combine", check_choice(f"{self.name} combine", self.combine, ScoreCombine))
        object.__setattr__(self, "head_reduce", check_choice(f"{self.name} head_reduce", self.head_reduce, HeadReduce))
        object.__setattr__(self, "_snap", SnapKVScorer(window=self.window, kernel_size=self.kernel_size,
                                                      pooling="max", head_reduce=self.head_reduce))
        trig = None if self.stats is None else TrigScorer(rope=self.rope, stats=self.stats,
                                                              value_weight=self.value_weight,
                                                              diversity_weight=self.diversity_weight)
        object.__setattr__(self, "_trig", trig)

    @property
    def decode_queries(self) -> bool:
        """Only without calibrated statistics (then SnapKV over the window decides every re-eviction)."""
        return self.stats is None

    @classmethod
    def reads_queries(cls, *, calibrated: bool) -> bool:
        """After the prompt: only without calibrated statistics (the window's bytes are then budgeted)."""
        return not calibrated

    @classmethod
    def state_bytes(cls, *, num_heads: int, head_dim: int, calibrated: bool) -> int:
        return TrigScorer.state_bytes(num_heads=num_heads, head_dim=head_dim, calibrated=calibrated)

    @property
    def calibrated(self) -> bool:
        return self.stats is not None

    def nbytes(self) -> int:
        return 0 if self.stats is None else self.stats.nbytes()

    @classmethod
    def layer_options(cls, *, rope: RopeSpec | None, stats: QueryStats | None, query_window: int) -> dict[str, Any]:
        """The model's RoPE, the layer's calibrated statistics and its query window as the observation window."""
        return {"rope": rope, "stats": stats, "window": query_window}

    def score(self, keys: Tensor, values: Tensor, *, queries: Tensor | None = None, key_positions: Tensor,
              query_positions: Tensor | None = None) -> Tensor:
        """keys, values: [B, Hkv, T, D]; queries: [B, H, W, D] (the prompt's last) or None (then trig on the
        calibrated stats); key_positions: [B, Hkv, T]; query_positions: [B, W] or None. Returns [B, Hkv, T]."""
        if queries is None:
            if self._trig is None:
                raise MoendError(f"{self.name} needs the prompt's queries or calibrated stats=QueryStats (a table)")
            return self._trig.score(keys, values, key_positions=key_positions)
        snap = self._snap.score(keys, values, queries=queries, key_positions=key_positions,
                                query_positions=query_positions)
        if not (self.trig_weight and self._trig is not None):
            return snap
        trig = self.trig_weight * standardise(self._trig.score(keys, values, key_positions=key_positions))
        if self.combine == ScoreCombine.MAX:
            return torch.maximum(standardise(snap), trig)
        return standardise(snap) + trig
