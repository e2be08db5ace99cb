"""Calibration on tiny random-weight models: capture hooks, S's structure, determinism, cross-checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moend_fx.attention.reference import attention_dense, reference_attention
from moend_fx.calibration.capture import AttentionCapture, attention_override
from moend_fx.calibration.data import random_token_sequences
from moend_fx.calibration.pipeline import (
    CalibrationSettings,
    calibrate,
    layer_errors,
    scorer_options,
    stale_reason,
    window_attention,
)
from moend_fx.calibration.settings import OPTIONS_BEFORE_RECORDED
from moend_fx.common.errors import MoendError
from moend_fx.eviction.query_stats import QueryStats
from moend_fx.eviction.rope import rope_from_model
from moend_fx.eviction.scorers import get_scorer
from moend_fx.models import tiny_model
from moend_fx.plan.memory import keep_count
from moend_fx.plan.routing import Grid, LayerConfig, ModelFingerprint
from moend_fx.storage.packed import PackedKV

TINY = dict(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", **TINY, seed=1)


@pytest.fixture(scope="module")
def table(model):
    return calibrate(model, tokens=192, num_sequences=2, seed=3)


@pytest.mark.parametrize("family,kw", [
    ("llama", dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)),
    ("qwen2", dict(num_layers=2, num_heads=4, num_kv_heads=4, head_dim=32)),
    ("mistral", dict(num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16)),
])
def test_capture_forward_matches_model(family, kw):
    m = tiny_model(family, **kw, seed=2)
    ids, _ = random_token_sequences(256, 1, 80, seed=5)
    stats: dict[int, QueryStats] = {}
    with torch.no_grad():
        want = m(input_ids=ids, use_cache=False).logits
        cap = AttentionCapture(m, window=16, rope=rope_from_model(m), stats=stats)
        with cap:
            got = m(input_ids=ids, use_cache=False).logits
    # same SDPA kernel on the same inputs; GQA via enable_gqa instead of repeat_kv may reorder sums
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert m.config._attn_implementation == "sdpa"  # restored
    assert sorted(cap.layers) == list(range(kw["num_layers"]))
    c = cap.layers[1]
    assert c.keys.shape == (1, kw["num_kv_heads"], 80, kw["head_dim"]) and c.values.shape == c.keys.shape
    assert c.queries.shape == (1, kw["num_heads"], 16, kw["head_dim"])
    assert c.query_positions.tolist() == [list(range(64, 80))]
    # every query but the 16 whose error is measured: the statistics never saw the measured window
    assert stats[0].count == 80 - 16 and stats[1].num_heads == kw["num_heads"]


def test_capture_keys_are_the_cache_keys(model):
    """The captured K/V are exactly what the HF cache stores after a prefill (post-RoPE)."""
    ids, _ = random_token_sequences(256, 1, 40, seed=6)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cap = AttentionCapture(model, window=8)
        with cap:
            model(input_ids=ids, use_cache=False)
    layer = out.cache.layers[2]
    torch.testing.assert_close(cap.layers[2].keys, layer.keys, rtol=0, atol=0)
    torch.testing.assert_close(cap.layers[2].values, layer.values, rtol=0, atol=0)


def test_override_restores_on_error(model):
    def boom(*a, **k):
        raise RuntimeError("boom")

    ids, _ = random_token_sequences(256, 1, 10, seed=0)
    with pytest.raises(RuntimeError, match="boom"), attention_override(model, boom):
        model(input_ids=ids, use_cache=False)
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)  # plain forward works again


def test_lossless_config_costs_only_its_16_bit_storage(table):
    """keep1_k16_v16 of an fp32 model stores K/V in fp16, as the cache does: its error is that rounding alone
    (2^-11 of a value; ~1e-4 of the attention output here), below every config that quantizes or evicts."""
    col = table.column(LayerConfig(1.0, 16, 16))
    assert (col > 0).all() and col.max() < 1e-3
    others = np.delete(table.S, table.grid.index(LayerConfig(1.0, 16, 16)), axis=1)
    assert (others > col[:, None]).all()


def test_monotone_in_keep_ratio(table):
    g = table.grid
    for kb in g.k_bits:
        for vb in g.v_bits:
            means = [table.column(LayerConfig(k, kb, vb)).mean() for k in sorted(g.keep_ratios)]
            # mean over layers shrinks as more tokens are kept
            assert all(a > b for a, b in zip(means, means[1:])), (kb, vb, means)


def test_monotone_in_bits(table):
    g = table.grid
    for keep in g.keep_ratios:
        for other in (16, 8):
            k_means = [table.column(LayerConfig(keep, b, other)).mean() for b in (16, 8, 4)]
            v_means = [table.column(LayerConfig(keep, other, b)).mean() for b in (16, 8, 4)]
            # fewer bits, more error on average; at keep < 1 eviction dominates, so allow ties within 1%
            tol = 1e-12 if keep == 1.0 else 1e-2
            for means in (k_means, v_means):
                assert all(b >= a * (1 - tol) for a, b in zip(means, means[1:])), (keep, other, means)
        if keep_count(192, keep) >= 32:  # fewer kept tokens than one group: all stay in the fp residual
            # at keep < 1 eviction dominates (S ~ 1 on this random model): ties within 1%, as above
            tol = 0.0 if keep == 1.0 else 1e-2
            four, sixteen = (table.column(LayerConfig(keep, b, b)).mean() for b in (4, 16))
            assert four > sixteen * (1 - tol), (keep, four, sixteen)


def test_same_seed_same_table(model, table):
    again = calibrate(model, tokens=192, num_sequences=2, seed=3)
    assert again.S.tobytes() == table.S.tobytes()
    assert all(np.array_equal(again.query_stats[k], table.query_stats[k]) for k in table.query_stats)
    other = calibrate(model, tokens=192, num_sequences=2, seed=4)
    assert not np.array_equal(other.S, table.S)


def test_table_metadata_and_stats(model, table, tmp_path):
    assert table.fingerprint == ModelFingerprint.from_model(model)
    assert table.calibration["tokens"] == 192 and table.calibration["num_sequences"] == 2
    assert table.calibration["scorer"] == "trig" and table.calibration["source"]["kind"] == "random"
    assert table.layer_stats(0).count == 2 * (192 - 64)  # every query but the measured window's (64)
    back = type(table).load(table.save(tmp_path / "t.safetensors"))
    assert back.S.tobytes() == table.S.tobytes()
    table.check_model(model)


def test_table_records_scorer_options_and_stale_tables_are_named(table, tmp_path):
    opts = table.calibration["scorer_options"]
    assert opts == scorer_options("trig") and opts["pooling"] == "max" and opts["kernel_size"] == 9
    back = type(table).load(table.save(tmp_path / "t.safetensors"))
    assert stale_reason(back) is None  # survives the JSON metadata round trip
    import dataclasses

    for cal in ({k: v for k, v in table.calibration.items() if k != "scorer_options"},  # an older table
                {**table.calibration, "scorer_options": {**opts, "kernel_size": 5}}):
        why = stale_reason(dataclasses.replace(table, calibration=cal))
        assert why is not None and "recalibrate" in why and "pooling" in why
    # an option a table predates counts at the behaviour before it; an option it records that this version lacks
    # and an option it lacks that has no such behaviour are stale
    aware = dataclasses.replace(table, calibration={**table.calibration, "scorer": "snapkv_trig",
                                                    "scorer_options": scorer_options("snapkv_trig")})
    assert stale_reason(aware) is None
    for name, before in OPTIONS_BEFORE_RECORDED.items():
        older = {k: v for k, v in scorer_options("snapkv_trig").items() if k != name}
        why = stale_reason(dataclasses.replace(aware, calibration={**aware.calibration, "scorer_options": older}))
        # current exactly when the behaviour before the option is still its default
        assert (why is None) == (before == scorer_options("snapkv_trig")[name])
        moved = {**older, name: next(m for m in type(before) if m != before)}  # the other behaviour, recorded
        why = stale_reason(dataclasses.replace(aware, calibration={**aware.calibration, "scorer_options": moved}))
        assert why is not None and name in why
    for options in ({k: v for k, v in opts.items() if k != "pooling"}, {**opts, "new_option": 1}):
        why = stale_reason(dataclasses.replace(table, calibration={**table.calibration, "scorer_options": options}))
        assert why is not None and "recalibrate" in why
    # a table from the first calibration (no version: statistics over the measured window, S not monotone)
    old = {k: v for k, v in table.calibration.items() if k != "version"}
    why = stale_reason(dataclasses.replace(table, calibration=old))
    assert why is not None and "calibration version 1" in why and "recalibrate" in why


@pytest.mark.parametrize("name", ["trig", "snapkv", "h2o", "keynorm", "streaming"])
def test_calibration_scores_with_the_scorer_the_cache_builds(model, name, monkeypatch):
    """Calibration measures what the cache will do: each layer's scorer equals the one MoENDCache builds for that
    layer (snapkv: the cache's query window, not calibration's longer error-measurement window), and the table
    records that scorer's options."""
    from moend_fx.cache.moend_cache import MoENDCache
    from moend_fx.calibration import pipeline
    from moend_fx.common.defaults import QUERY_WINDOW
    from moend_fx.plan.routing import RoutingPlan

    used = []

    def spy(cap, grid, scorer, **kw):
        used.append(scorer)
        return layer_errors(cap, grid, scorer, **kw)

    monkeypatch.setattr(pipeline, "layer_errors", spy)
    t = calibrate(model, tokens=96, num_sequences=1, scorer=name, grid=Grid((0.5, 1.0), (16,), (16,)))
    fp = ModelFingerprint.from_model(model)
    plan = RoutingPlan(layers=(LayerConfig(0.5, 16, 16),) * fp.num_layers, fingerprint=fp, budget_bytes=1,
                       context_length=96, scorer=name)
    cache = MoENDCache(plan, rope=rope_from_model(model), query_stats=[t.layer_stats(i) for i in range(fp.num_layers)])
    assert used == [layer.scorer for layer in cache.layers]
    assert t.calibration["scorer_options"] == scorer_options(name)
    if name == "snapkv":
        assert t.calibration["window"] == 64 and {s.window for s in used} == {QUERY_WINDOW}
        assert scorer_options(name)["window"] == QUERY_WINDOW
    if name == "trig":
        assert all(s.stats is not None for s in used)  # calibrated statistics, as the cache gets from the table


def _captured(model, tokens: int, seed: int, window: int, layer: int):
    """One layer's capture of a prefill of ``tokens`` random ids."""
    ids, _ = random_token_sequences(256, 1, tokens, seed=seed)
    with torch.no_grad():
        cap = AttentionCapture(model, window=window)
        with cap:
            model(input_ids=ids, use_cache=False)
    return cap.layers[layer]


def test_table_matches_reference_path(model):
    """One S entry recomputed with the cache's own pieces: PackedKV + reference_attention (no eviction)."""
    c = _captured(model, 150, seed=9, window=24, layer=1)
    grid = Grid((1.0,), (16, 4), (16, 8))
    errs = layer_errors(c, grid, get_scorer("keynorm"))
    ref = attention_dense(c.queries, c.keys, c.values, scale=c.scaling)
    for cfg in [LayerConfig(1.0, 4, 8), LayerConfig(1.0, 16, 8), LayerConfig(1.0, 4, 16)]:
        layer = PackedKV.from_dense(c.keys, c.values, cfg, 32)
        out = reference_attention(c.queries, layer, scale=c.scaling)
        want = float((out.double() - ref.double()).norm() / ref.double().norm())
        # fp32 attention along two code paths (mask via positions vs bottom-right chunk mask)
        assert errs[grid.index(cfg)] == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_eviction_entry_by_hand(model):
    """keep < 1: the kept tokens are selected as the cache selects them and queries see them by position."""
    from moend_fx.eviction.selection import evict

    c = _captured(model, 128, seed=11, window=48, layer=0)
    grid = Grid((0.25,), (16,), (16,))
    scorer = get_scorer("keynorm")
    (err,) = layer_errors(c, grid, scorer)
    kp = c.key_positions[:, None].expand(1, 2, 128)
    scores = scorer.score(c.keys, c.values, key_positions=kp)
    k, v, pos = evict(c.keys, c.values, scores, 0.25, key_positions=kp)
    mask = pos.repeat_interleave(2, dim=1)[:, :, None, :] <= c.query_positions[:, None, :, None]
    out = attention_dense(c.queries, k, v, scale=c.scaling, causal_chunk=False, mask=mask)
    ref = attention_dense(c.queries, c.keys, c.values, scale=c.scaling)
    want = float((out.double() - ref.double()).norm() / ref.double().norm())
    assert err == pytest.approx(want, rel=1e-4)  # fp32 attention, two code paths


def test_window_attention_matches_attention_dense():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 10, 16, generator=g)
    k = torch.randn(1, 2, 30, 16, generator=g)
    v1, v2 = torch.randn(1, 2, 30, 16, generator=g), torch.randn(1, 2, 30, 16, generator=g)
    pos = torch.arange(30)
    allowed = (pos[None, None, None, None, :] <= pos[-10:][None, None, None, :, None])
    outs = window_attention(q, k, [v1, v2], allowed, 0.25)
    for v, o in zip((v1, v2), outs):
        want = attention_dense(q, k, v, scale=0.25)
        torch.testing.assert_close(o.reshape(1, 6, 10, 16), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scorer", ["snapkv", "keynorm", "streaming", "h2o"])
def test_other_scorers(model, scorer):
    grid = Grid((0.5, 1.0), (16, 4), (16,))
    t = calibrate(model, tokens=96, num_sequences=1, scorer=scorer, grid=grid)
    assert t.calibration["scorer"] == scorer
    assert t.S.shape == (3, 4) and t.column(LayerConfig(1.0, 16, 16)).max() < 1e-3  # fp16 storage rounding only
    assert (t.column(LayerConfig(0.5, 16, 16)) > 0).all()


def test_token_ids_input(model):
    ids, _ = random_token_sequences(256, 2, 64, seed=1)
    t = calibrate(model, token_ids=ids, grid=Grid((0.5, 1.0), (16,), (16, 4)))
    assert t.calibration["tokens"] == 64 and t.calibration["num_sequences"] == 2
    assert t.calibration["source"] == {"kind": "token_ids"}
    assert t.calibration["retrieval_tails"] == 0  # the caller's ids are used as given


def test_bad_input(model):
    with pytest.raises(MoendError, match="window=0"):
        CalibrationSettings(window=0)
    with pytest.raises(MoendError, match="scorer='nope'"):
        calibrate(model, scorer="nope")
    with pytest.raises(MoendError, match="unknown option"):
        calibrate(model, tokenz=5)
    with pytest.raises(MoendError, match="integer"):
        calibrate(model, token_ids=torch.rand(1, 10))
    with pytest.raises(MoendError, match="group_size=24"):
        CalibrationSettings(group_size=24)


def test_text_calibration_with_a_tokenizer(model):
    """Licence + synthetic text through a byte-level stand-in tokenizer; deterministic per seed."""
    from moend_fx.calibration.data import text_token_sequences

    class ByteTok:
        def __call__(self, text, return_tensors=None, add_special_tokens=False):
            return {"input_ids": torch.tensor([list(text.encode("utf-8"))])}

        def decode(self, ids):  # the default retrieval tail reads the records back
            return bytes(ids).decode("utf-8", errors="replace")

    a, src = text_token_sequences(ByteTok(), 2, 300, seed=7)
    b, _ = text_token_sequences(ByteTok(), 2, 300, seed=7)
    h, src_h = text_token_sequences(ByteTok(), 2, 300, seed=7, split="heldout")
    assert a.shape == (2, 300) and torch.equal(a, b) and not torch.equal(a, h)
    assert not set(src["licenses"]) & set(src_h["licenses"])  # disjoint licence halves
    t = calibrate(model, ByteTok(), tokens=300, num_sequences=1, grid=Grid((0.5, 1.0), (16,), (16,)))
    assert t.calibration["source"]["kind"] == "text"


# --------------------------------------------------------------------------- measure="top1"


def test_window_top1_matches_a_loop_over_rows():
    """window_top1 against a plain per-row argmax over the allowed keys (random keys at scattered positions)."""
    from moend_fx.calibration.pipeline import window_top1

    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 6, 7, 16, generator=g)
    k = torch.randn(2, 3, 20, 16, generator=g)
    pos = torch.sort(torch.randperm(60, generator=g)[:20]).values.expand(2, 3, 20).contiguous()
    qpos = torch.arange(53, 60).expand(2, 7)
    allowed = pos[:, :, None, None, :] <= qpos[:, None, None, :, None]
    got = window_top1(q, k, pos, allowed)
    for b in range(2):
        for h in range(6):
            for w in range(7):
                kv = h // 2
                logits = k[b, kv] @ q[b, h, w]
                logits[pos[b, kv] > qpos[b, w]] = float("-inf")
                assert got[b, kv, h % 2, w] == pos[b, kv, int(logits.argmax())]


def test_top1_measure_counts_changed_winners_and_ignores_values(model):
    c = _captured(model, 160, seed=5, window=32, layer=1)
    grid = Grid((0.25, 1.0), (16, 4), (16, 4))
    scorer = get_scorer("keynorm")
    top1 = layer_errors(c, grid, scorer, measure="top1")
    l2 = layer_errors(c, grid, scorer)
    assert ((top1 >= 0) & (top1 <= 1)).all()
    rows = c.queries.shape[1] * c.queries.shape[2]  # heads x window queries
    assert np.allclose(top1 * rows, np.round(top1 * rows))  # a share of rows
    # fp16 storage may flip a near-tie (1 row of 128 here); 4-bit K flips many more
    assert top1[grid.index(LayerConfig(1.0, 16, 16))] <= 2 / rows < top1[grid.index(LayerConfig(1.0, 4, 16))]
    for keep, kb in [(0.25, 16), (0.25, 4), (1.0, 4)]:
        # V plays no part in which key wins; the L2 measure does see V's bits
        assert top1[grid.index(LayerConfig(keep, kb, 16))] == top1[grid.index(LayerConfig(keep, kb, 4))]
    assert l2[grid.index(LayerConfig(1.0, 16, 4))] > l2[grid.index(LayerConfig(1.0, 16, 16))]
    assert top1[grid.index(LayerConfig(0.25, 16, 16))] > 0  # evicting 75% of random keys loses some winners


def test_top1_table_records_its_measure(model):
    t = calibrate(model, tokens=96, num_sequences=1, grid=Grid((0.5, 1.0), (16, 4), (16,)), measure="top1",
                  gain_probe=None)
    assert t.calibration["measure"] == "top1" and "highest-logit key" in t.calibration["metric"]
    assert calibrate(model, tokens=96, num_sequences=1, grid=Grid((1.0,), (16,), (16,)),
                     gain_probe=None).calibration["measure"] == "l2"


def test_unknown_measure_is_a_clear_error():
    with pytest.raises(MoendError, match="measure.*allowed.*l2.*top1"):
        CalibrationSettings(measure="kl")
