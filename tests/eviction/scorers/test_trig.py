"""TrigScorer: the averaged-logit series against brute force, its pooling and norm term, on-the-fly statistics,
and its options."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.common.errors import MoendError
from moend_fx.eviction.query_stats import QueryStats
from moend_fx.eviction.rope import RopeSpec, apply_rope, to_complex
from moend_fx.eviction.scorers import get_scorer
from tests.eviction.scorers.helpers import SHAPES, build, positions, randn, trig_brute

FAST = settings(max_examples=25, deadline=None)


def _trig_rotated_means(keys, qbar, spec, offsets, t_now):
    """Same expectation from explicitly rotated mean queries: mean_delta rope(qbar, t_now + delta) . k."""
    b, hkv, t, d = keys.shape
    h = qbar.shape[0]
    qvec = torch.cat((qbar.real, qbar.imag), -1)[None, :, None, :].expand(b, h, 1, d)
    acc = torch.zeros(b, h, t, dtype=torch.float64)
    for delta in offsets:
        qr = apply_rope(qvec, (t_now + delta)[:, None], spec)  # [B, H, 1, D]
        acc += torch.einsum("bhd,bhtd->bht", qr[:, :, 0], keys.double().repeat_interleave(h // hkv, 1))
    return (acc / len(offsets)).reshape(b, hkv, h // hkv, t).mean(2)


@FAST
@given(
    **SHAPES,
    t=st.integers(1, 12),
    half=st.sampled_from([2, 4, 8]),
    scaling=st.sampled_from([1.0, 1.2]),
    max_offset=st.sampled_from([1, 16, 300]),
)
def test_trig_matches_brute_force(seed, b, hkv, group, t, half, scaling, max_offset):
    d, h = 2 * half, hkv * group
    spec = RopeSpec(RopeSpec.default(d, theta=500.0).inv_freq, attention_scaling=scaling)
    kp = positions(seed, b, hkv, t)
    keys = apply_rope(randn(seed, b, hkv, t, d, dtype=torch.float64), kp, spec).float()
    stats = QueryStats.empty(h, d).accumulate(randn(seed + 1, 2, h, 9, d) + randn(seed + 2, 1, h, 1, d))
    scorer = get_scorer("trig", rope=spec, stats=stats, max_offset=max_offset, pooling="none",
                        norm_weight=0.0, value_weight=0.0, diversity_weight=0.0)
    got = scorer.score(keys, keys, key_positions=kp)
    t_now = kp.reshape(b, -1).amax(1) + 1
    ref = trig_brute(keys, kp, stats.mean, stats.abs_mean, spec, scorer.offsets, t_now)
    scale = (stats.abs_mean.sum(-1).max() * to_complex(keys.double()).abs().sum(-1).max()).item()
    # float32 keys and float32 RoPE angles (positions < 400): errors ~1e-5 of the largest possible logit
    assert torch.allclose(got.double(), ref, atol=2e-5 * scale + 1e-6)
    # the coherent part equals the explicitly rotated mean query's averaged dot product
    coherent_ref = _trig_rotated_means(keys, stats.mean, spec, scorer.offsets, t_now)
    m = (stats.abs_mean - stats.mean.abs()) * scaling
    kabs = to_complex(keys.double()).abs()  # [B, Hkv, T, F]
    mag = torch.einsum("bktf,kf->bkt", kabs, m.reshape(hkv, group, half).mean(1))
    assert torch.allclose(got.double() - mag, coherent_ref, atol=2e-5 * scale + 1e-6)


@FAST
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(1, 40), kernel=st.sampled_from([1, 3, 5, 9]))
def test_trig_is_standardised_with_the_norm_and_value_terms_then_max_pooled(seed, t, kernel):
    """The default trig score is z(z(plain score) + z(-||k||)) + z(||v||), max-pooled over ``kernel_size``
    stored neighbours (a window cut at the ends)."""
    d, hkv, group = 16, 2, 2
    spec = RopeSpec.default(d)
    kp = positions(seed, 1, hkv, t)
    keys, values = randn(seed, 1, hkv, t, d), randn(seed + 3, 1, hkv, t, d) * 2.0
    stats = QueryStats.empty(hkv * group, d).accumulate(randn(seed + 1, 2, hkv * group, 5, d))
    raw = get_scorer("trig", rope=spec, stats=stats, pooling="none", diversity_weight=0.0).score(
        keys, values, key_positions=kp)
    plain = get_scorer("trig", rope=spec, stats=stats, pooling="none", norm_weight=0.0, value_weight=0.0,
                       diversity_weight=0.0)
    trig = plain.score(keys, values, key_positions=kp)
    z = lambda x: (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True, correction=0).clamp_min(1e-12)  # noqa: E731
    # default norm_weight 1 and value_weight 1 (float32 z-scores)
    assert torch.allclose(raw, z(z(trig) + z(-keys.norm(dim=-1))) + z(values.norm(dim=-1)), atol=1e-4)
    no_value = get_scorer("trig", rope=spec, stats=stats, pooling="none", value_weight=0.0, diversity_weight=0.0)
    assert torch.allclose(no_value.score(keys, values, key_positions=kp), z(trig) + z(-keys.norm(dim=-1)),
                          atol=1e-4)
    pooled = get_scorer("trig", rope=spec, stats=stats, kernel_size=kernel, diversity_weight=0.0).score(
        keys, values, key_positions=kp)
    r = kernel // 2
    ref = torch.stack([raw[..., max(0, i - r): i + r + 1].amax(-1) for i in range(t)], dim=-1)
    assert torch.equal(pooled, ref)  # a max selects one of the inputs: exact


def test_value_term_ranks_first_a_token_whose_value_is_large():
    """Tokens 3 and 7 share a key; token 7's value is 4x the largest other. With the value term it ranks first,
    without it the plain score puts another token first (the control: the check can fail)."""
    d, hkv, t = 16, 1, 12
    spec = RopeSpec.default(d)
    kp = torch.arange(t)[None, None]
    keys = randn(5, 1, hkv, t, d)
    keys[..., 7, :] = keys[..., 3, :]
    values = randn(6, 1, hkv, t, d)
    values[..., 7, :] = values[..., 7, :] / values[..., 7, :].norm() * 4 * values.norm(dim=-1).max()
    stats = QueryStats.empty(2, d).accumulate(randn(7, 2, 2, 5, d))
    kw = dict(rope=spec, stats=stats, pooling="none", diversity_weight=0.0)
    with_v = get_scorer("trig", **kw).score(keys, values, key_positions=kp)
    without = get_scorer("trig", value_weight=0.0, **kw)
    assert int(with_v[0, 0].argmax()) == 7
    assert int(without.score(keys, values, key_positions=kp)[0, 0].argmax()) != 7


@FAST
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(4, 40), w=st.sampled_from([None, 0.25, 1.0, 2.0]))
def test_diversity_term_adds_the_standardised_pre_rope_novelty(seed, t, w):
    """With ``diversity_weight`` w (default 0.5) the score is z(the score without it) + w z(-cos(pre-RoPE key,
    mean pre-RoPE key)).
    (From 4 tokens: with 2, both novelties are equal and their z-scores are float32 rounding noise.)"""
    d, hkv = 16, 2
    spec = RopeSpec.default(d)
    kp = positions(seed, 1, hkv, t)
    pre = randn(seed, 1, hkv, t, d, dtype=torch.float64) + 0.5 * randn(seed + 5, 1, hkv, 1, d, dtype=torch.float64)
    keys = apply_rope(pre, kp, spec).float()
    values = randn(seed + 3, 1, hkv, t, d)
    stats = QueryStats.empty(hkv * 2, d).accumulate(randn(seed + 1, 2, hkv * 2, 5, d))
    base = get_scorer("trig", rope=spec, stats=stats, pooling="none", diversity_weight=0.0).score(
        keys, values, key_positions=kp)
    kw = {} if w is None else {"diversity_weight": w}
    got = get_scorer("trig", rope=spec, stats=stats, pooling="none", **kw).score(keys, values, key_positions=kp)
    w = 0.5 if w is None else w
    unit = pre / pre.norm(dim=-1, keepdim=True)
    mean = unit.mean(dim=2, keepdim=True)
    novelty = -(unit * mean / mean.norm(dim=-1, keepdim=True)).sum(-1)
    z = lambda x: (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True, correction=0).clamp_min(1e-12)  # noqa: E731
    # float32 z-scores of float32 keys un-rotated in float64
    assert torch.allclose(got, z(base) + w * z(novelty.float()), atol=1e-4)


def test_diversity_term_ranks_first_a_key_unlike_a_repeated_phrase():
    """Twenty copies of a 3-token phrase (one pre-RoPE key per phrase token, each copy at its own positions, a
    little noise) and one unique token at position 31, its key as long as theirs: with the diversity term it ranks
    first; without it, it does not (the control: the check can fail)."""
    d, t, target = 16, 64, 31
    spec = RopeSpec.default(d)
    phrase = randn(0, 3, d, dtype=torch.float64)
    pre = torch.stack([phrase[i % 3] for i in range(t)])[None, None] + 0.05 * randn(1, 1, 1, t, d,
                                                                                     dtype=torch.float64)
    unique = randn(2, d, dtype=torch.float64)
    pre[0, 0, target] = unique / unique.norm() * pre[0, 0].norm(dim=-1).mean()
    kp = torch.arange(t)[None, None]
    keys = apply_rope(pre, kp, spec).float()
    values = randn(3, 1, 1, t, d)
    values[0, 0, target] = values[0, 0, target] / values[0, 0, target].norm() * values[0, 0].norm(dim=-1).mean()
    stats = QueryStats.empty(2, d).accumulate(randn(4, 2, 2, 5, d))
    kw = dict(rope=spec, stats=stats, pooling="none")
    with_div = get_scorer("trig", diversity_weight=2.0, **kw).score(keys, values, key_positions=kp)
    without = get_scorer("trig", diversity_weight=0.0, **kw).score(keys, values, key_positions=kp)
    assert int(with_div[0, 0].argmax()) == target
    assert int(without[0, 0].argmax()) != target


def test_novelty_ignores_where_a_key_sits():
    """The same pre-RoPE key at two positions has one novelty (RoPE is undone first); post-RoPE they differ."""
    d, t = 16, 10
    spec = RopeSpec.default(d)
    pre = randn(0, 1, 1, t, d, dtype=torch.float64)
    pre[0, 0, 7] = pre[0, 0, 2]
    kp = (torch.arange(t) * 37)[None, None]
    keys = apply_rope(pre, kp, spec).float()
    nov = get_scorer("trig", rope=spec).novelty(keys, kp)
    assert not torch.allclose(keys[0, 0, 2], keys[0, 0, 7], atol=1e-3)
    assert abs(float(nov[0, 0, 2] - nov[0, 0, 7])) < 1e-5  # float32 un-rotation of the two copies


def test_trig_on_the_fly_equals_calibrated_from_same_queries():
    d, hkv, group, t, w = 16, 2, 3, 30, 7
    spec = RopeSpec.default(d)
    kp = positions(0, 1, hkv, t)
    keys = randn(1, 1, hkv, t, d)
    qp = torch.arange(kp.max() - w + 1, kp.max() + 1)[None]
    q = apply_rope(randn(2, 1, hkv * group, w, d), qp, spec)
    stats = QueryStats.empty(hkv * group, d).accumulate_rotated(q, qp, spec)
    fly = get_scorer("trig", rope=spec).score(keys, keys, queries=q, key_positions=kp, query_positions=qp)
    cal = get_scorer("trig", rope=spec, stats=stats).score(keys, keys, key_positions=kp)
    # float32 un-rotation of the queries on the fly vs float64 accumulation
    assert torch.allclose(fly, cal, rtol=1e-4, atol=1e-4)


def test_key_in_mean_query_direction_ranks_high():
    """A key that, after RoPE, points where the mean future query points gets a top score among random keys."""
    d, h, t, w, target = 64, 1, 64, 8, 30
    spec = RopeSpec.default(d)
    mu = randn(0, d, dtype=torch.float64)
    q_pre = mu + 0.3 * randn(1, 1, h, w, d, dtype=torch.float64)  # coherent pre-RoPE queries
    kp = torch.arange(t)[None, None]
    keys_pre = randn(2, 1, 1, t, d, dtype=torch.float64)
    # pre-RoPE key = the mean query rotated by the distance to now: after RoPE both point the same way
    k_dir = apply_rope(mu[None, None, None], torch.tensor([t - target]), spec)[0, 0, 0]
    keys_pre[0, 0, target] = k_dir / k_dir.norm() * keys_pre.norm(dim=-1).mean()
    keys_rot = apply_rope(keys_pre, kp, spec).float()
    scorer = get_scorer("trig", rope=spec, stats=QueryStats.empty(h, d).accumulate(q_pre))
    s = scorer.score(keys_rot, keys_rot, key_positions=kp)
    assert int((s[0, 0] > s[0, 0, target]).sum()) <= 2


def test_trig_options_and_inputs_are_checked():
    spec = RopeSpec.default(8)
    keys, kp = randn(0, 1, 2, 6, 8), torch.arange(6)
    with pytest.raises(MoendError, match="rope"):
        get_scorer("trig")
    with pytest.raises(MoendError, match="norm_weight=-1.*>= 0"):
        get_scorer("trig", rope=spec, norm_weight=-1)
    with pytest.raises(MoendError, match="value_weight=-1.*>= 0"):
        get_scorer("trig", rope=spec, value_weight=-1)
    with pytest.raises(MoendError, match="diversity_weight=-1.*>= 0"):
        get_scorer("trig", rope=spec, diversity_weight=-1)
    with pytest.raises(MoendError, match="offsets"):
        build("trig", 8, offsets=())
    with pytest.raises(MoendError, match="stats head_dim 4"):
        get_scorer("trig", rope=spec, stats=QueryStats.empty(2, 4).accumulate(randn(0, 1, 2, 3, 4)))
    with pytest.raises(MoendError, match="stats are empty"):
        get_scorer("trig", rope=spec, stats=QueryStats.empty(2, 8))
    with pytest.raises(MoendError, match="stats"):
        build("trig", 8).score(keys, keys, key_positions=kp)  # neither stats nor queries
    with pytest.raises(MoendError, match="head_dim"):
        build("trig", 16).score(keys, keys, key_positions=kp)
