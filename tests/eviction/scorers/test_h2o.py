"""H2OScorer: accumulated attention against a dense float64 computation, chunked or not; its options."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.common.errors import MoendError
from moend_fx.eviction.scorers import get_scorer
from tests.eviction.scorers.helpers import dense_attention_sums, gen, positions, randn

FAST = settings(max_examples=25, deadline=None)


@FAST
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(1, 40), w=st.integers(1, 40), chunk=st.integers(1, 7))
def test_h2o_chunked_equals_unchunked_and_dense(seed, t, w, chunk):
    b, hkv, group, d = 2, 2, 2, 8
    keys, q = randn(seed, b, hkv, t, d), randn(seed + 1, b, hkv * group, w, d)
    kp = positions(seed, b, hkv, t)
    qp = torch.sort(torch.randint(0, int(kp.max()) + 3, (b, w), generator=gen(seed)), -1).values
    full = get_scorer("h2o", chunk=10_000).score(keys, keys, queries=q, key_positions=kp, query_positions=qp)
    chunked = get_scorer("h2o", chunk=chunk).score(keys, keys, queries=q, key_positions=kp, query_positions=qp)
    # same float32 numbers summed in a different order
    assert torch.allclose(full, chunked, rtol=1e-5, atol=1e-5)
    ref = dense_attention_sums(q, keys, kp, qp, d**-0.5).reshape(b, hkv, group, t).mean(2)
    assert torch.allclose(full.double(), ref, atol=1e-5)
    no_mask = get_scorer("h2o").score(keys, keys, queries=q, key_positions=kp)
    ref = dense_attention_sums(q, keys, kp, None, d**-0.5).reshape(b, hkv, group, t).mean(2)
    assert torch.allclose(no_mask.double(), ref, atol=1e-5)


@pytest.mark.parametrize("name", ["h2o", "snapkv"])  # the attention column sums both score with
def test_attention_scorers_check_their_queries_and_options(name):
    keys, kp = randn(0, 1, 2, 6, 8), torch.arange(6)
    with pytest.raises(MoendError, match=f"scorer '{name}' needs queries"):
        get_scorer(name).score(keys, keys, key_positions=kp)
    for bad in (randn(1, 1, 3, 2, 8), randn(1, 1, 2, 2, 4)):  # 3 heads over 2 KV heads; head_dim 4 != 8
        with pytest.raises(MoendError, match="queries"):
            get_scorer(name).score(keys, keys, queries=bad, key_positions=kp)
    with pytest.raises(MoendError, match="query_positions"):
        get_scorer(name).score(keys, keys, queries=randn(1, 1, 2, 2, 8), key_positions=kp,
                               query_positions=torch.arange(3))
    with pytest.raises(MoendError, match=f"{name} scale=-1"):
        get_scorer(name, scale=-1)
    with pytest.raises(MoendError, match=f"{name} chunk=0"):
        get_scorer(name, chunk=0)
