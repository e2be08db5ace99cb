"""StreamingLLM: keep the sinks plus the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moend_fx.common.options import ScorerName
from moend_fx.eviction.scorers.base import KeysOnlyScorer, Tensor


@dataclass(frozen=True)
class StreamingScorer(KeysOnlyScorer):
    """score = key position: the selection's sinks are always kept, and then the later the better."""

    name: ClassVar[str] = ScorerName.STREAMING

    def score_keys(self, keys: Tensor, key_positions: Tensor) -> Tensor:
        return key_positions.float().contiguous()
