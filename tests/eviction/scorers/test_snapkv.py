"""SnapKVScorer: pooled window attention against a dense float64 computation, its window, its options."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.common.errors import MoendError
from moend_fx.eviction.rope import RopeSpec, apply_rope
from moend_fx.eviction.scorers import get_scorer
from tests.eviction.scorers.helpers import SHAPES, dense_attention_sums, pool_naive, positions, randn

FAST = settings(max_examples=25, deadline=None)


@pytest.mark.parametrize("head_reduce", ["mean", "max"])
@pytest.mark.parametrize("pooling", ["avg", "max"])
@FAST
@given(
    **SHAPES,
    t=st.integers(1, 20),
    w=st.integers(1, 6),
    kernel=st.sampled_from([1, 3, 5]),
)
def test_snapkv_matches_dense(pooling, head_reduce, seed, b, hkv, group, t, w, kernel):
    d, h = 8, hkv * group
    keys, q = randn(seed, b, hkv, t, d), randn(seed + 1, b, h, w, d)
    kp = positions(seed, b, hkv, t)
    qp = kp.amax(dim=(1, 2))[:, None] - w + 1 + torch.arange(w)
    got = get_scorer("snapkv", kernel_size=kernel, pooling=pooling, chunk=2, head_reduce=head_reduce).score(
        keys, keys, queries=q, key_positions=kp, query_positions=qp
    )
    att = dense_attention_sums(q, keys, kp, qp, d**-0.5)  # [B, H, T]
    per_head = pool_naive(att, kernel, pooling).reshape(b, hkv, group, t)
    ref = per_head.amax(2) if head_reduce == "max" else per_head.mean(2)
    # float32 softmax vs float64: attention sums <= w, so 1e-5 absolute
    assert torch.allclose(got.double(), ref, atol=1e-5)


def test_max_over_heads_keeps_a_key_one_head_of_the_group_attends_to():
    """One query head of a group of 8 looks sharply at a key the other 7 ignore (a retrieval head): by their mean
    the key ranks among the random ones, by their max it ranks first."""
    d, group, t, w, target = 32, 8, 64, 4, 20
    keys = randn(0, 1, 1, t, d)
    q = 0.3 * randn(1, 1, group, w, d)
    q[0] += keys[0, 0, 40] * 0.8  # every head leans towards key 40
    q[0, 3] = keys[0, 0, target] * 2.0  # head 3 looks at the target
    kp = torch.arange(t)
    scores = {r: get_scorer("snapkv", kernel_size=1, head_reduce=r).score(keys, keys, queries=q, key_positions=kp)
              for r in ("mean", "max")}
    assert int(scores["max"][0, 0].argmax()) == target
    assert int(scores["mean"][0, 0].argmax()) != target
    with pytest.raises(MoendError, match="head_reduce='min'.*mean, max"):
        get_scorer("snapkv", head_reduce="min")


def test_snapkv_window_scores_with_the_last_queries_only():
    keys, q = randn(0, 1, 2, 12, 8), randn(1, 1, 4, 6, 8)
    kp, qp = torch.arange(12), torch.arange(6, 12)
    windowed = get_scorer("snapkv", window=2).score(keys, keys, queries=q, key_positions=kp, query_positions=qp)
    last = get_scorer("snapkv").score(keys, keys, queries=q[:, :, -2:], key_positions=kp, query_positions=qp[-2:])
    assert torch.equal(windowed, last)
    every = get_scorer("snapkv").score(keys, keys, queries=q, key_positions=kp, query_positions=qp)
    assert not torch.equal(windowed, every)


def test_key_in_mean_query_direction_ranks_high():
    """A key pointing where the window's (post-RoPE) queries point gets a top score among random keys."""
    d, h, t, w, target = 64, 1, 64, 8, 30
    spec = RopeSpec.default(d)
    q_pre = randn(0, d, dtype=torch.float64) + 0.3 * randn(1, 1, h, w, d, dtype=torch.float64)
    kp, qp = torch.arange(t)[None, None], torch.arange(t, t + w)[None]
    keys_rot = apply_rope(randn(2, 1, 1, t, d, dtype=torch.float64), kp, spec)
    q_rot = apply_rope(q_pre, qp, spec)
    mean_q = q_rot.mean(2)[0, 0]
    keys_rot[0, 0, target] = mean_q / mean_q.norm() * keys_rot.norm(dim=-1).mean()
    s = get_scorer("snapkv").score(keys_rot.float(), keys_rot.float(), queries=q_rot.float(), key_positions=kp,
                                   query_positions=qp)
    assert int((s[0, 0] > s[0, 0, target]).sum()) <= 2


def test_snapkv_options_are_checked():
    with pytest.raises(MoendError, match="pooling"):
        get_scorer("snapkv", pooling="median")
    with pytest.raises(MoendError, match="kernel_size"):
        get_scorer("snapkv", kernel_size=4)
    with pytest.raises(MoendError, match="snapkv window=0"):
        get_scorer("snapkv", window=0)
