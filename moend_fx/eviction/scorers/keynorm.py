"""Knorm: low-norm keys draw attention, so keep them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moend_fx.common.options import ScorerName
from moend_fx.eviction.scorers.base import KeysOnlyScorer, Tensor


@dataclass(frozen=True)
class KeyNormScorer(KeysOnlyScorer):
    """score = -||k|| (key_positions are checked, not used)."""

    name: ClassVar[str] = ScorerName.KEYNORM

    def score_keys(self, keys: Tensor, key_positions: Tensor) -> Tensor:
        return -keys.float().norm(dim=-1)
