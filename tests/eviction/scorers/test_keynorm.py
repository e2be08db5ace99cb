"""KeyNormScorer: -||k||, and the key checks every scorer shares."""

from __future__ import annotations

import pytest
import torch

from moend_fx.common.errors import MoendError
from moend_fx.eviction.scorers import get_scorer
from tests.eviction.scorers.helpers import positions, randn


def test_keynorm_is_minus_the_key_norm():
    keys = randn(0, 1, 2, 5, 4)
    kp = positions(0, 1, 2, 5)
    assert torch.allclose(get_scorer("keynorm").score(keys, keys, key_positions=kp), -keys.norm(dim=-1))


def test_keys_values_and_positions_are_checked():
    keys, kp = randn(0, 1, 2, 6, 8), torch.arange(6)
    with pytest.raises(MoendError, match="keys"):
        get_scorer("keynorm").score(keys[0], keys[0], key_positions=kp)
    with pytest.raises(MoendError, match="no tokens"):
        get_scorer("keynorm").score(keys[:, :, :0], keys[:, :, :0], key_positions=kp[:0])
    with pytest.raises(MoendError, match="values"):
        get_scorer("keynorm").score(keys, keys[:, :, :3], key_positions=kp)
    with pytest.raises(MoendError, match="key_positions"):
        get_scorer("keynorm").score(keys, keys, key_positions=torch.arange(5))
