"""Token selection: sinks and the recent window first, then scores with ties to the later position; evict()."""

from __future__ import annotations

import math

import pytest
import torch

from moend_fx.common.errors import MoendError
from moend_fx.eviction.selection import evict, select_tokens
from tests.eviction.scorers.helpers import gen, randn


def test_selection_prefers_scores_then_later_ties():
    scores = torch.tensor([[[0.0, 5.0, 1.0, 5.0, 2.0, 5.0, 0.0, 0.0]]])
    idx, _ = select_tokens(scores, 4, sink_tokens=1, recent_tokens=1)
    # sink 0 and recent 7 forced; then the two later of the three tied 5.0 scores
    assert idx.tolist() == [[[0, 3, 5, 7]]]
    # ties broken by key position, not storage order
    kp = torch.tensor([0, 10, 1, 9, 2, 8, 3, 4])
    idx, pos = select_tokens(scores, 4, sink_tokens=1, recent_tokens=1, key_positions=kp)
    assert idx.tolist() == [[[0, 1, 3, 7]]] and pos.tolist() == [[[0, 10, 9, 4]]]


def test_selection_minus_inf_last_and_clamp():
    scores = torch.tensor([[[1.0, -math.inf, 3.0, -math.inf, float("nan"), 2.0]]])
    idx, _ = select_tokens(scores, 3, sink_tokens=0, recent_tokens=0)
    assert idx.tolist() == [[[0, 2, 5]]]
    idx, _ = select_tokens(scores, 5, sink_tokens=0, recent_tokens=0)
    assert set(idx.flatten().tolist()) >= {0, 2, 5}
    # n_keep < sinks + recent: sinks first, then the most recent
    s = torch.randn(1, 1, 20, generator=gen(0))
    idx, _ = select_tokens(s, 6, sink_tokens=4, recent_tokens=32)
    assert idx.tolist() == [[[0, 1, 2, 3, 18, 19]]]
    idx, _ = select_tokens(s, 2, sink_tokens=4, recent_tokens=32)
    assert idx.tolist() == [[[0, 1]]]


def test_evict_gathers_the_selected_tokens():
    keys, values = randn(0, 1, 2, 10, 4), randn(1, 1, 2, 10, 6)
    scores, kp = randn(2, 1, 2, 10), torch.arange(100, 110)
    k, v, pos = evict(keys, values, scores, 0.5, key_positions=kp, sink_tokens=1, recent_tokens=2)
    idx, want = select_tokens(scores, 5, sink_tokens=1, recent_tokens=2, key_positions=kp)
    assert torch.equal(pos, want) and torch.equal(pos - 100, idx)
    for h in range(2):
        assert torch.equal(k[0, h], keys[0, h, idx[0, h]]) and torch.equal(v[0, h], values[0, h, idx[0, h]])


def test_bad_input():
    keys = randn(0, 1, 2, 6, 8)
    scores = torch.zeros(1, 2, 6)
    for n in (0, 7):
        with pytest.raises(MoendError, match="n_keep"):
            select_tokens(scores, n)
    with pytest.raises(MoendError, match="scores"):
        select_tokens(scores[0], 2)
    with pytest.raises(MoendError, match="sink_tokens=-1"):
        select_tokens(scores, 2, sink_tokens=-1)
    for r in (0.0, 1.5):
        with pytest.raises(MoendError, match="keep_ratio"):
            evict(keys, keys, scores, r)
    with pytest.raises(MoendError, match="scores"):
        evict(keys, keys, scores[:, :1], 0.5)
