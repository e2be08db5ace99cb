"""Eviction scorers and selection: one table of all scorers, checked for the selection contract, against
brute-force references, and for bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.common.errors import MoendError
from moend_fx.eviction.rope import QueryStats, RopeSpec, apply_rope, invert_rope, to_complex
from moend_fx.eviction.scoring import SCORERS, evict, get_scorer, select_tokens
from moend_fx.plan.memory import keep_count

FAST = settings(max_examples=25, deadline=None)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(seed: int, *shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed), dtype=torch.float64).to(dtype)


def _positions(seed: int, b: int, hkv: int, t: int) -> torch.Tensor:
    """Non-contiguous increasing positions [B, Hkv, T], different per head (as after an eviction)."""
    gaps = torch.randint(1, 6, (b, hkv, t), generator=_gen(seed))
    return gaps.cumsum(-1) - 1


def _build(name: str, head_dim: int, **kw):
    if name == "trig":
        return get_scorer("trig", rope=RopeSpec.default(head_dim, theta=1000.0), **kw)
    return get_scorer(name, **kw)


def _expected_forced(t: int, n: int, sinks: int, recent: int) -> set[int]:
    """Stored indices the selection must keep: sinks first, then the most recent that fit."""
    s = list(range(min(sinks, t)))
    r = [i for i in range(t - 1, max(t - recent, 0) - 1, -1) if i not in s]
    forced = s[:n]
    forced += r[: max(0, n - len(forced))]
    return set(forced)


@pytest.mark.parametrize("name", sorted(SCORERS))
@FAST
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 2),
    hkv=st.integers(1, 3),
    group=st.integers(1, 3),
    t=st.integers(1, 70),
    half=st.sampled_from([2, 4, 8]),
    keep_ratio=st.sampled_from([0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]),
    sinks=st.integers(0, 5),
    recent=st.integers(0, 40),
    w=st.integers(1, 8),
)
def test_every_scorer_keeps_sinks_recent_and_count(name, seed, b, hkv, group, t, half, keep_ratio, sinks, recent, w):
    d = 2 * half
    keys, values = _randn(seed, b, hkv, t, d), _randn(seed + 1, b, hkv, t, d + 2)
    kp = _positions(seed, b, hkv, t)
    queries = _randn(seed + 2, b, hkv * group, w, d)
    # query-aware window: the queries are the last w tokens (some of them may precede stored keys' ends)
    qp = kp.amax(dim=(1, 2))[:, None] - w + 1 + torch.arange(w)
    scorer = _build(name, d)
    scores = scorer.score(keys, values, queries=queries, key_positions=kp, query_positions=qp)
    assert scores.shape == (b, hkv, t) and scores.dtype == torch.float32
    assert torch.isfinite(scores).all()

    k2, v2, pos = evict(keys, values, scores, keep_ratio, key_positions=kp, sink_tokens=sinks, recent_tokens=recent)
    n = keep_count(t, keep_ratio)
    assert k2.shape == (b, hkv, n, d) and v2.shape == (b, hkv, n, d + 2) and pos.shape == (b, hkv, n)
    idx, kept_pos = select_tokens(scores, n, sink_tokens=sinks, recent_tokens=recent, key_positions=kp)
    assert idx.dtype == torch.int64 and kept_pos.dtype == torch.int64
    assert torch.equal(kept_pos, pos)
    assert (idx[..., 1:] > idx[..., :-1]).all()  # sorted and unique
    assert torch.equal(kept_pos, kp.gather(-1, idx))
    assert torch.equal(k2, keys.gather(2, idx[..., None].expand(-1, -1, -1, d)))
    forced = _expected_forced(t, n, sinks, recent)
    for row in idx.reshape(-1, n).tolist():
        assert forced <= set(row)


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
    s = torch.randn(1, 1, 20, generator=_gen(0))
    idx, _ = select_tokens(s, 6, sink_tokens=4, recent_tokens=32)
    assert idx.tolist() == [[[0, 1, 2, 3, 18, 19]]]
    idx, _ = select_tokens(s, 2, sink_tokens=4, recent_tokens=32)
    assert idx.tolist() == [[[0, 1]]]


def _trig_brute(keys, kp, qbar, eabs, spec, offsets, t_now):
    """Averaged logit from the explicit series on un-rotated keys, per query head, then group mean.

    keys [B, Hkv, T, D] post-RoPE; qbar [H, F] complex; eabs [H, F]; returns [B, Hkv, T] float64.
    """
    b, hkv, t, d = keys.shape
    h = qbar.shape[0]
    g = h // hkv
    kpre = to_complex(invert_rope(keys.double(), kp, spec))  # [B, Hkv, T, F]
    w = torch.tensor(spec.inv_freq, dtype=torch.float64)
    s2 = spec.attention_scaling**2
    out = torch.zeros(b, hkv, g, t, dtype=torch.float64)
    for head in range(h):
        kv, gi = divmod(head, g)
        qf = qbar[head]
        for delta in offsets:
            tt = t_now[:, None, None].double() + delta  # [B, 1, 1]
            ang = w * (tt - kp[:, kv, :, None].double()) + qf.angle() - kpre[:, kv].angle()
            out[:, kv, gi] += s2 * (qf.abs() * kpre[:, kv].abs() * torch.cos(ang)).sum(-1) / len(offsets)
        out[:, kv, gi] += s2 * ((eabs[head] - qf.abs()) * kpre[:, kv].abs()).sum(-1)
    return out.mean(dim=2)


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
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 2),
    hkv=st.integers(1, 2),
    group=st.integers(1, 3),
    t=st.integers(1, 12),
    half=st.sampled_from([2, 4, 8]),
    scaling=st.sampled_from([1.0, 1.2]),
    max_offset=st.sampled_from([1, 16, 300]),
)
def test_trig_matches_brute_force(seed, b, hkv, group, t, half, scaling, max_offset):
    d, h = 2 * half, hkv * group
    spec = RopeSpec(RopeSpec.default(d, theta=500.0).inv_freq, attention_scaling=scaling)
    kp = _positions(seed, b, hkv, t)
    keys = apply_rope(_randn(seed, b, hkv, t, d, dtype=torch.float64), kp, spec).float()
    stats = QueryStats.empty(h, d).accumulate(_randn(seed + 1, 2, h, 9, d) + _randn(seed + 2, 1, h, 1, d))
    scorer = get_scorer("trig", rope=spec, stats=stats, max_offset=max_offset, pooling="none",
                        norm_weight=0.0)
    got = scorer.score(keys, keys, key_positions=kp)
    t_now = kp.reshape(b, -1).amax(1) + 1
    ref = _trig_brute(keys, kp, stats.mean, stats.abs_mean, spec, scorer.offsets, t_now)
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
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(1, 40), kernel=st.sampled_from([1, 3, 5, 9]),
       pads=st.integers(0, 3))
def test_trig_pooling_is_max_over_stored_neighbours(seed, t, kernel, pads):
    """The default trig score is the raw score max-pooled over ``kernel_size`` stored neighbours (a window
    cut at the ends), and tokens scored -inf (padding) stay -inf whatever their neighbours score."""
    d, hkv, group = 16, 2, 2
    spec = RopeSpec.default(d)
    kp = _positions(seed, 1, hkv, t)
    keys = _randn(seed, 1, hkv, t, d)
    stats = QueryStats.empty(hkv * group, d).accumulate(_randn(seed + 1, 2, hkv * group, 5, d))
    raw = get_scorer("trig", rope=spec, stats=stats, pooling="none").score(keys, keys, key_positions=kp)
    plain = get_scorer("trig", rope=spec, stats=stats, pooling="none", norm_weight=0.0)
    trig = plain.score(keys, keys, key_positions=kp)
    z = lambda x: (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True, correction=0).clamp_min(1e-12)  # noqa: E731
    # default norm_weight 1: standardised trig + standardised -||k|| (float32 z-scores)
    assert torch.allclose(raw, z(trig) + z(-keys.norm(dim=-1)), atol=1e-4)
    pooled = get_scorer("trig", rope=spec, stats=stats, kernel_size=kernel).score(keys, keys, key_positions=kp)
    r = kernel // 2
    ref = torch.stack([raw[..., max(0, i - r): i + r + 1].amax(-1) for i in range(t)], dim=-1)
    assert torch.equal(pooled, ref)  # a max selects one of the inputs: exact
    from moend_fx.eviction.scoring_inputs import _pool_scores

    masked = raw.clone()
    masked[..., : min(pads, t)] = float("-inf")
    for mode in ("max", "avg"):
        out = _pool_scores(masked, kernel, mode)
        assert torch.isneginf(out[..., : min(pads, t)]).all()
        assert torch.isfinite(out[..., min(pads, t):]).all()  # avg pools the finite neighbours only


def test_pooling_options_are_checked():
    spec = RopeSpec.default(8)
    with pytest.raises(MoendError, match="pooling='sum'.*allowed"):
        get_scorer("trig", rope=spec, pooling="sum")
    with pytest.raises(MoendError, match="kernel_size=4.*odd"):
        get_scorer("trig", rope=spec, kernel_size=4)
    with pytest.raises(MoendError, match="kernel_size=0.*odd"):
        get_scorer("snapkv", kernel_size=0)
    with pytest.raises(MoendError, match="norm_weight=-1.*>= 0"):
        get_scorer("trig", rope=spec, norm_weight=-1)


def test_trig_on_the_fly_equals_calibrated_from_same_queries():
    d, hkv, group, t, w = 16, 2, 3, 30, 7
    spec = RopeSpec.default(d)
    kp = _positions(0, 1, hkv, t)
    keys = _randn(1, 1, hkv, t, d)
    qp = torch.arange(kp.max() - w + 1, kp.max() + 1)[None]
    q = apply_rope(_randn(2, 1, hkv * group, w, d), qp, spec)
    stats = QueryStats.empty(hkv * group, d).accumulate_rotated(q, qp, spec)
    fly = get_scorer("trig", rope=spec).score(keys, keys, queries=q, key_positions=kp, query_positions=qp)
    cal = get_scorer("trig", rope=spec, stats=stats).score(keys, keys, key_positions=kp)
    # float32 un-rotation of the queries on the fly vs float64 accumulation
    assert torch.allclose(fly, cal, rtol=1e-4, atol=1e-4)


def _dense_attention_sums(queries, keys, kp, qp, scale):
    """Naive: repeat K to every query head, dense masked softmax, sum over queries: [B, H, T] float64."""
    h, hkv = queries.shape[1], keys.shape[1]
    k = keys.double().repeat_interleave(h // hkv, 1)
    kpos = kp.repeat_interleave(h // hkv, 1)
    logits = queries.double() @ k.transpose(-1, -2) * scale  # [B, H, W, T]
    if qp is not None:
        logits = logits.masked_fill(kpos[:, :, None, :] > qp[:, None, :, None], -math.inf)
    return torch.softmax(logits, -1).nan_to_num(0.0).sum(2)


@pytest.mark.parametrize("pooling", ["avg", "max"])
@FAST
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 2),
    hkv=st.integers(1, 2),
    group=st.integers(1, 3),
    t=st.integers(1, 20),
    w=st.integers(1, 6),
    kernel=st.sampled_from([1, 3, 5]),
)
def test_snapkv_matches_dense(pooling, seed, b, hkv, group, t, w, kernel):
    d, h = 8, hkv * group
    keys, q = _randn(seed, b, hkv, t, d), _randn(seed + 1, b, h, w, d)
    kp = _positions(seed, b, hkv, t)
    qp = kp.amax(dim=(1, 2))[:, None] - w + 1 + torch.arange(w)
    got = get_scorer("snapkv", kernel_size=kernel, pooling=pooling, chunk=2).score(
        keys, keys, queries=q, key_positions=kp, query_positions=qp
    )
    att = _dense_attention_sums(q, keys, kp, qp, d**-0.5)  # [B, H, T]
    r = kernel // 2
    pooled = torch.empty_like(att)
    for i in range(t):  # reference pools token by token (no padding counted)
        win = att[..., max(0, i - r) : i + r + 1]
        pooled[..., i] = win.mean(-1) if pooling == "avg" else win.amax(-1)
    ref = pooled.reshape(b, hkv, group, t).mean(2)
    # float32 softmax vs float64: attention sums <= w, so 1e-5 absolute
    assert torch.allclose(got.double(), ref, atol=1e-5)


@FAST
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(1, 40), w=st.integers(1, 40), chunk=st.integers(1, 7))
def test_h2o_chunked_equals_unchunked_and_dense(seed, t, w, chunk):
    b, hkv, group, d = 2, 2, 2, 8
    keys, q = _randn(seed, b, hkv, t, d), _randn(seed + 1, b, hkv * group, w, d)
    kp = _positions(seed, b, hkv, t)
    qp = torch.sort(torch.randint(0, int(kp.max()) + 3, (b, w), generator=_gen(seed)), -1).values
    full = get_scorer("h2o", chunk=10_000).score(keys, keys, queries=q, key_positions=kp, query_positions=qp)
    chunked = get_scorer("h2o", chunk=chunk).score(keys, keys, queries=q, key_positions=kp, query_positions=qp)
    # same float32 numbers summed in a different order
    assert torch.allclose(full, chunked, rtol=1e-5, atol=1e-5)
    ref = _dense_attention_sums(q, keys, kp, qp, d**-0.5).reshape(b, hkv, group, t).mean(2)
    assert torch.allclose(full.double(), ref, atol=1e-5)
    no_mask = get_scorer("h2o").score(keys, keys, queries=q, key_positions=kp)
    ref = _dense_attention_sums(q, keys, kp, None, d**-0.5).reshape(b, hkv, group, t).mean(2)
    assert torch.allclose(no_mask.double(), ref, atol=1e-5)


def test_keynorm_and_streaming_values():
    keys = _randn(0, 1, 2, 5, 4)
    kp = _positions(0, 1, 2, 5)
    assert torch.allclose(get_scorer("keynorm").score(keys, keys, key_positions=kp), -keys.norm(dim=-1))
    assert torch.equal(get_scorer("streaming").score(keys, keys, key_positions=kp), kp.float())
    idx, pos = select_tokens(kp.float(), 3, sink_tokens=1, recent_tokens=0, key_positions=kp)
    assert idx.tolist() == [[[0, 3, 4], [0, 3, 4]]]


@pytest.mark.parametrize("name", ["trig", "snapkv"])
def test_key_in_mean_query_direction_ranks_high(name):
    """A key pointing where the (future) queries point gets a top score among random keys."""
    d, h, t, w = 64, 1, 64, 8
    spec = RopeSpec.default(d)
    mu = _randn(0, d, dtype=torch.float64)
    q_pre = mu + 0.3 * _randn(1, 1, h, w, d, dtype=torch.float64)  # coherent pre-RoPE queries
    kp = torch.arange(t)[None, None]
    keys_pre = _randn(2, 1, 1, t, d, dtype=torch.float64)
    target = 30
    norm = keys_pre.norm(dim=-1).mean()
    qp = torch.arange(t, t + w)[None]
    if name == "trig":
        # pre-RoPE key = the mean query rotated by the distance to now: after RoPE both point the same way
        t_now = t
        k_dir = apply_rope(mu[None, None, None], torch.tensor([t_now - target]), spec)[0, 0, 0]
        stats = QueryStats.empty(h, d).accumulate(q_pre)
        scorer = get_scorer("trig", rope=spec, stats=stats)
    else:
        k_dir = None
        scorer = get_scorer("snapkv")
    keys_rot = apply_rope(keys_pre, kp, spec)
    q_rot = apply_rope(q_pre, qp, spec)
    if name == "trig":
        keys_pre[0, 0, target] = k_dir / k_dir.norm() * norm
        keys_rot = apply_rope(keys_pre, kp, spec)
    else:
        mean_q = q_rot.mean(2)[0, 0]
        keys_rot[0, 0, target] = mean_q / mean_q.norm() * norm
    s = scorer.score(keys_rot.float(), keys_rot.float(), queries=q_rot.float(), key_positions=kp, query_positions=qp)
    rank = int((s[0, 0] > s[0, 0, target]).sum())
    assert rank <= 2, f"{name}: target ranked {rank} of {t}"


def test_bad_input():
    keys = _randn(0, 1, 2, 6, 8)
    kp = torch.arange(6)
    with pytest.raises(MoendError, match="allowed"):
        get_scorer("tova")
    with pytest.raises(MoendError, match="allowed"):
        get_scorer("snapkv", windw=3)
    with pytest.raises(MoendError, match="rope"):
        get_scorer("trig")
    for name in ("snapkv", "h2o"):
        with pytest.raises(MoendError, match="needs queries"):
            get_scorer(name).score(keys, keys, key_positions=kp)
    with pytest.raises(MoendError, match="stats"):
        _build("trig", 8).score(keys, keys, key_positions=kp)
    with pytest.raises(MoendError, match="keys"):
        get_scorer("keynorm").score(keys[0], keys[0], key_positions=kp)
    with pytest.raises(MoendError, match="values"):
        get_scorer("keynorm").score(keys, keys[:, :, :3], key_positions=kp)
    with pytest.raises(MoendError, match="key_positions"):
        get_scorer("keynorm").score(keys, keys, key_positions=torch.arange(5))
    with pytest.raises(MoendError, match="integer"):
        get_scorer("streaming").score(keys, keys, key_positions=kp.float())
    with pytest.raises(MoendError, match="queries"):
        get_scorer("snapkv").score(keys, keys, queries=_randn(1, 1, 3, 2, 8), key_positions=kp)
    with pytest.raises(MoendError, match="queries"):
        get_scorer("h2o").score(keys, keys, queries=_randn(1, 1, 2, 2, 4), key_positions=kp)
    with pytest.raises(MoendError, match="query_positions"):
        get_scorer("h2o").score(
            keys, keys, queries=_randn(1, 1, 2, 2, 8), key_positions=kp, query_positions=torch.arange(3)
        )
    with pytest.raises(MoendError, match="head_dim"):
        _build("trig", 16).score(keys, keys, key_positions=kp)
    with pytest.raises(MoendError, match="pooling"):
        get_scorer("snapkv", pooling="median")
    with pytest.raises(MoendError, match="kernel_size"):
        get_scorer("snapkv", kernel_size=4)
    with pytest.raises(MoendError, match="offsets"):
        _build("trig", 8, offsets=())
    scores = torch.zeros(1, 2, 6)
    for n in (0, 7):
        with pytest.raises(MoendError, match="n_keep"):
            select_tokens(scores, n)
    with pytest.raises(MoendError, match="scores"):
        select_tokens(scores[0], 2)
    for r in (0.0, 1.5):
        with pytest.raises(MoendError, match="keep_ratio"):
            evict(keys, keys, scores, r)
    with pytest.raises(MoendError, match="scores"):
        evict(keys, keys, scores[:, :1], 0.5)


def test_float16_keys_score_in_float32():
    keys = _randn(0, 1, 2, 10, 8, dtype=torch.float16)
    q = _randn(1, 1, 4, 3, 8, dtype=torch.float16)
    kp = torch.arange(10)
    for name in sorted(SCORERS):
        s = _build(name, 8).score(keys, keys, queries=q, key_positions=kp, query_positions=torch.arange(7, 10))
        assert s.dtype == torch.float32 and torch.isfinite(s).all(), name
