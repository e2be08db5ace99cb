"""Every registered scorer, table-driven: the selection contract on its scores, its values against a naive
float64 computation, what ``needs_queries`` says, and the one factory (``build_scorer``) the cache and calibration
share."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.common.defaults import QUERY_WINDOW
from moend_fx.common.errors import MoendError
from moend_fx.eviction.query_stats import QueryStats
from moend_fx.eviction.rope import RopeSpec, invert_rope, to_complex
from moend_fx.eviction.scorers import SCORERS, Scorer, SnapKVScorer, build_scorer, default_options, get_scorer
from moend_fx.eviction.selection import evict, select_tokens
from moend_fx.plan.memory import keep_count
from tests.eviction.scorers.helpers import (
    SHAPES,
    build,
    dense_attention_sums,
    pool_naive,
    positions,
    randn,
    trig_brute,
)

FAST = settings(max_examples=25, deadline=None)
NAMES = sorted(SCORERS)


def _expected_forced(t: int, n: int, sinks: int, recent: int) -> set[int]:
    """Stored indices the selection must keep: sinks first, then the most recent that fit."""
    s = list(range(min(sinks, t)))
    r = [i for i in range(t - 1, max(t - recent, 0) - 1, -1) if i not in s]
    forced = s[:n]
    forced += r[: max(0, n - len(forced))]
    return set(forced)


@pytest.mark.parametrize("name", NAMES)
@FAST
@given(
    **{**SHAPES, "hkv": st.integers(1, 3)},
    t=st.integers(1, 70),
    half=st.sampled_from([2, 4, 8]),
    keep_ratio=st.sampled_from([0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]),
    sinks=st.integers(0, 5),
    recent=st.integers(0, 40),
    w=st.integers(1, 8),
)
def test_every_scorer_keeps_sinks_recent_and_count(name, seed, b, hkv, group, t, half, keep_ratio, sinks, recent, w):
    d = 2 * half
    keys, values = randn(seed, b, hkv, t, d), randn(seed + 1, b, hkv, t, d + 2)
    kp = positions(seed, b, hkv, t)
    queries = randn(seed + 2, b, hkv * group, w, d)
    # query-aware window: the queries are the last w tokens (some of them may precede stored keys' ends)
    qp = kp.amax(dim=(1, 2))[:, None] - w + 1 + torch.arange(w)
    scores = build(name, d).score(keys, values, queries=queries, key_positions=kp, query_positions=qp)
    assert scores.shape == (b, hkv, t) and scores.dtype == torch.float32
    assert torch.isfinite(scores).all()

    k2, v2, pos = evict(keys, values, scores, keep_ratio, key_positions=kp, sink_tokens=sinks, recent_tokens=recent)
    n = keep_count(t, keep_ratio, floor=sinks + recent)  # never fewer than the sinks and recent window
    assert k2.shape == (b, hkv, n, d) and v2.shape == (b, hkv, n, d + 2) and pos.shape == (b, hkv, n)
    idx, kept_pos = select_tokens(scores, n, sink_tokens=sinks, recent_tokens=recent, key_positions=kp)
    assert idx.dtype == torch.int64 and kept_pos.dtype == torch.int64
    assert torch.equal(kept_pos, pos)
    assert (idx[..., 1:] > idx[..., :-1]).all()  # sorted and unique: exactly n distinct tokens per head
    assert torch.equal(kept_pos, kp.gather(-1, idx))  # the kept tokens' true positions
    assert torch.equal(k2, keys.gather(2, idx[..., None].expand(-1, -1, -1, d)))
    assert torch.equal(v2, values.gather(2, idx[..., None].expand(-1, -1, -1, d + 2)))
    forced = _expected_forced(t, n, sinks, recent)
    for row in idx.reshape(-1, n).tolist():
        assert forced <= set(row)


# --------------------------------------------------------------------------- values against naive float64 maths

D, HKV, GROUP, T, W = 8, 2, 2, 10, 3
SPEC = RopeSpec.default(D, theta=1000.0)
# trig without its pooling, norm and value terms here: those have their own tests (test_trig.py)
OPTIONS = {"trig": dict(pooling="none", norm_weight=0.0, value_weight=0.0, diversity_weight=0.0)}


def _naive_trig(keys, q, kp, qp):
    z = to_complex(invert_rope(q, qp, SPEC))  # [1, H, W, F] pre-RoPE queries
    qbar, eabs = z.mean(2)[0], z.abs().mean(2)[0]
    t_now = torch.maximum(kp.max(), qp.max())[None] + 1
    offsets = build("trig", D).offsets
    return trig_brute(keys, kp.expand(1, HKV, T), qbar, eabs, SPEC, offsets, t_now)


def _naive_snapkv(keys, q, kp, qp, kernel=5, pooling="avg", heads="mean"):
    att = dense_attention_sums(q, keys, kp.expand(1, HKV, T), qp, D**-0.5)  # [1, H, T]
    per_head = pool_naive(att, kernel, pooling).reshape(1, HKV, GROUP, T)
    return per_head.amax(2) if heads == "max" else per_head.mean(2)


NAIVE = {
    "trig": _naive_trig,
    "snapkv": _naive_snapkv,
    "snapkv_trig": lambda keys, q, kp, qp: _naive_snapkv(keys, q, kp, qp, 9, "max"),  # with the prompt's queries
    "h2o": lambda keys, q, kp, qp: dense_attention_sums(q, keys, kp.expand(1, HKV, T), qp, D**-0.5).reshape(
        1, HKV, GROUP, T).mean(2),
    "keynorm": lambda keys, q, kp, qp: -keys.norm(dim=-1),
    "streaming": lambda keys, q, kp, qp: kp.double().expand(1, HKV, T),
}


def test_every_registered_scorer_has_a_naive_reference():
    assert set(NAIVE) == set(SCORERS)


@pytest.mark.parametrize("name", NAMES)
def test_float16_inputs_score_in_float32_and_match_naive_float64(name):
    keys = randn(0, 1, HKV, T, D, dtype=torch.float16)
    q = randn(1, 1, HKV * GROUP, W, D, dtype=torch.float16)
    kp, qp = torch.arange(T), torch.arange(T - W, T)[None]
    scorer = build(name, D, **OPTIONS.get(name, {}))
    got = scorer.score(keys, keys, queries=q, key_positions=kp, query_positions=qp)
    assert got.dtype == torch.float32
    # the float16 values are upcast before any arithmetic: the same scores as float32 copies of them
    same = scorer.score(keys.float(), keys.float(), queries=q.float(), key_positions=kp, query_positions=qp)
    assert torch.equal(got, same)
    ref = NAIVE[name](keys.double(), q.double(), kp, qp)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- needs_queries


def _with_stats() -> Scorer:
    stats = QueryStats.empty(HKV * GROUP, D).accumulate(randn(5, 1, HKV * GROUP, 4, D))
    return get_scorer("trig", rope=SPEC, stats=stats)


@pytest.mark.parametrize("scorer", [build(n, D) for n in NAMES] + [_with_stats()],
                         ids=NAMES + ["trig-calibrated"])
def test_needs_queries_says_whether_score_reads_queries(scorer):
    keys, q = randn(0, 1, HKV, T, D), randn(1, 1, HKV * GROUP, W, D)
    kp = torch.arange(T)
    expected = {"keynorm": False, "streaming": False, "snapkv": True, "h2o": True, "snapkv_trig": True}
    assert scorer.needs_queries is (scorer.stats is None if scorer.name == "trig" else expected[scorer.name])
    if scorer.needs_queries:
        with pytest.raises(MoendError, match="queries"):
            scorer.score(keys, keys, key_positions=kp)
    else:
        # scores without queries are the scores with them (query positions aside: they move trig's "now")
        with_q = scorer.score(keys, keys, queries=q, key_positions=kp)
        assert torch.equal(scorer.score(keys, keys, key_positions=kp), with_q)


# --------------------------------------------------------------------------- the factory


def test_build_scorer_gives_each_scorer_what_it_takes_from_the_layer():
    stats = _with_stats().stats
    trig = build_scorer("trig", rope=SPEC, stats=stats)
    assert trig.rope == SPEC and trig.stats is stats and not trig.needs_queries
    assert build_scorer("snapkv").window == QUERY_WINDOW  # the cache's query window, in calibration too
    assert build_scorer("snapkv", query_window=8).window == 8
    assert build_scorer("snapkv", None, None, 8, kernel_size=3) == SnapKVScorer(window=8, kernel_size=3)
    assert build_scorer("snapkv", query_window=8, window=4).window == 4  # explicit options win
    assert build_scorer("h2o", rope=SPEC, stats=stats) == get_scorer("h2o")  # RoPE and stats ignored
    mine = SnapKVScorer(window=3)
    assert build_scorer(mine, query_window=99) is mine
    with pytest.raises(MoendError, match="rope"):
        build_scorer("trig")
    with pytest.raises(MoendError, match="scorer='tova' is unknown"):
        build_scorer("tova")


@pytest.mark.parametrize("name", NAMES)
def test_default_options_are_what_build_scorer_builds(name):
    """The options a table records (calibration) are the options the cache's scorer has."""
    built = build_scorer(name, rope=SPEC)
    recorded = default_options(name)
    assert recorded == {k: getattr(built, k) for k in recorded}
    assert not {"rope", "stats", "offsets"} & set(recorded)
    assert set(recorded) <= {f.name for f in dataclasses.fields(type(built))}


def test_get_scorer_names_and_options_are_checked():
    with pytest.raises(MoendError, match="unknown scorer 'tova'; allowed: h2o, keynorm"):
        get_scorer("tova")
    with pytest.raises(MoendError, match=r"takes no option\(s\) \['windw'\]"):
        get_scorer("snapkv", windw=3)
