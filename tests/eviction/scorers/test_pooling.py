"""Score pooling: options checked, padding (-inf) never lifted by a real neighbour."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.common.errors import MoendError
from moend_fx.common.options import Pooling
from moend_fx.eviction.rope import RopeSpec
from moend_fx.eviction.scorers import get_scorer
from moend_fx.eviction.scorers.pooling import pool_scores
from tests.eviction.scorers.helpers import pool_naive, randn

FAST = settings(max_examples=25, deadline=None)


@FAST
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(1, 40), kernel=st.sampled_from([1, 3, 5, 9]),
       pads=st.integers(0, 3))
def test_pooling_matches_naive_and_keeps_padding_at_minus_inf(seed, t, kernel, pads):
    scores = randn(seed, 2, 3, t)
    for mode in ("max", "avg"):
        torch.testing.assert_close(pool_scores(scores, kernel, mode), pool_naive(scores, kernel, mode))
    masked = scores.clone()
    masked[..., : min(pads, t)] = float("-inf")
    for mode in ("max", "avg"):
        out = pool_scores(masked, kernel, mode)
        assert torch.isneginf(out[..., : min(pads, t)]).all()
        assert torch.isfinite(out[..., min(pads, t):]).all()  # avg pools the finite neighbours only
    assert pool_scores(scores, kernel, Pooling.NONE) is scores


def test_pooling_options_are_checked():
    spec = RopeSpec.default(8)
    assert get_scorer("trig", rope=spec, pooling="avg").pooling is Pooling.AVG  # plain strings are taken
    with pytest.raises(MoendError, match="pooling='sum'.*allowed"):
        get_scorer("trig", rope=spec, pooling="sum")
    with pytest.raises(MoendError, match="kernel_size=4.*odd"):
        get_scorer("trig", rope=spec, kernel_size=4)
    with pytest.raises(MoendError, match="kernel_size=0.*odd"):
        get_scorer("snapkv", kernel_size=0)
