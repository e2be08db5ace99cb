"""held.real_row_scores: a padded row is scored on its real tokens alone, as the same row is without padding."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.eviction.evictor import Evictor
from moend_fx.eviction.held import real_row_scores
from moend_fx.eviction.policy import EvictionPolicy
from moend_fx.eviction.query_stats import QueryStats
from moend_fx.eviction.rope import RopeSpec
from moend_fx.eviction.scorers import get_scorer
from moend_fx.plan.routing import LayerConfig
from tests.eviction.scorers.helpers import randn

D, HKV, GROUP = 16, 2, 2


def _evictor(offsets: list[int]) -> Evictor:
    """A keep-0.5 K4/V4 layer's Evictor with the default trig scorer (standardised: its scores depend on which
    tokens it sees) and rope_offset [B] = offsets."""
    stats = QueryStats.empty(HKV * GROUP, D).accumulate(randn(11, 2, HKV * GROUP, 5, D))
    scorer = get_scorer("trig", rope=RopeSpec.default(D), stats=stats)
    ev = Evictor(LayerConfig(0.5, 4, 4), 32, EvictionPolicy(), scorer, layer_idx=0)
    ev.rope_offset = torch.tensor(offsets)
    return ev


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(4, 40), pad=st.integers(1, 30))
def test_padded_row_gets_the_scores_it_gets_alone(seed, n, pad):
    """Row 1 of k, v: [2, Hkv, n + pad, D] is ``pad`` left pads (random, non-zero values) then n real tokens:
    its scores at the real slots equal those of the n tokens alone (the same float32 ops on the same values:
    1e-5), -inf at the pads; row 0, all real, gets its own scores."""
    t = n + pad
    k, v = randn(seed, 2, HKV, t, D), randn(seed + 1, 2, HKV, t, D)
    pos = torch.arange(t).expand(2, HKV, t)
    valid = torch.ones(2, HKV, t, dtype=torch.bool)
    valid[1, :, :pad] = False
    got = real_row_scores(k, v, pos, valid, _evictor([0, pad]).scores)
    alone = _evictor([0]).scores(k[1:, :, pad:], v[1:, :, pad:], torch.arange(n).expand(1, HKV, n), None, None)
    assert torch.isneginf(got[1, :, :pad]).all()
    assert torch.allclose(got[1, :, pad:], alone[0], atol=1e-5)
    full = _evictor([0]).scores(k[:1], v[:1], pos[:1], None, None)
    assert torch.allclose(got[0], full[0], atol=1e-5)


def test_scoring_the_padding_too_would_change_a_row_s_scores():
    """The control: scored with its pads in the standardisation, the padded row's scores differ from alone."""
    n, pad = 24, 16
    t = n + pad
    k, v = randn(3, 2, HKV, t, D), randn(4, 2, HKV, t, D) * 3
    pos = torch.arange(t).expand(2, HKV, t)
    with_pads = _evictor([0, pad]).scores(k, v, pos, None, None)[1, :, pad:]
    alone = _evictor([0]).scores(k[1:, :, pad:], v[1:, :, pad:], torch.arange(n).expand(1, HKV, n), None, None)
    assert not torch.allclose(with_pads, alone[0], atol=1e-3)
