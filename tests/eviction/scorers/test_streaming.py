"""StreamingScorer: score = position, so the selection keeps the sinks and the most recent tokens."""

from __future__ import annotations

import pytest
import torch

from moend_fx.common.errors import MoendError
from moend_fx.eviction.scorers import get_scorer
from moend_fx.eviction.selection import select_tokens
from tests.eviction.scorers.helpers import positions, randn


def test_streaming_scores_positions_and_keeps_sinks_plus_latest():
    keys = randn(0, 1, 2, 5, 4)
    kp = positions(0, 1, 2, 5)
    scores = get_scorer("streaming").score(keys, keys, key_positions=kp)
    assert torch.equal(scores, kp.float())
    idx, pos = select_tokens(scores, 3, sink_tokens=1, recent_tokens=0, key_positions=kp)
    assert idx.tolist() == [[[0, 3, 4], [0, 3, 4]]] and torch.equal(pos, kp[..., [0, 3, 4]])


def test_streaming_positions_must_be_integers():
    keys = randn(0, 1, 2, 6, 8)
    with pytest.raises(MoendError, match="integer"):
        get_scorer("streaming").score(keys, keys, key_positions=torch.arange(6).float())
