"""Calibration measures the tokens the cache keeps: for the same prompt, plan and statistics, the tokens
calibration scores S on are exactly the tokens a MoENDCache prefill keeps, layer by layer and head by head."""

from __future__ import annotations

import pytest
import torch

from moend_fx.cache.moend_cache import MoENDCache
from moend_fx.calibration.capture import AttentionCapture
from moend_fx.calibration.prefill import kept_tokens
from moend_fx.common.defaults import CALIBRATION_WINDOW, RECENT_TOKENS, SINK_TOKENS
from moend_fx.eviction.query_stats import QueryStats
from moend_fx.eviction.rope import rope_from_model
from moend_fx.eviction.scorers import build_scorer
from moend_fx.models import tiny_model
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, seed=1)


@pytest.mark.parametrize("scorer", ["trig", "snapkv_trig", "snapkv"])
@pytest.mark.parametrize("keep", [0.1, 0.5])
@torch.no_grad()
def test_calibration_and_the_cache_keep_the_same_tokens(model, scorer, keep):
    fp = ModelFingerprint.from_model(model)
    ids = torch.randint(3, 256, (1, 300), generator=torch.Generator().manual_seed(4))
    rope = rope_from_model(model)
    stats: dict[int, QueryStats] = {}
    cap = AttentionCapture(model, window=CALIBRATION_WINDOW, rope=rope, stats=stats)
    with cap:
        model(input_ids=ids, use_cache=False)
    # 16-bit sides: nothing is quantized, so the only thing that differs between the two paths is selection
    plan = RoutingPlan(layers=(LayerConfig(keep, 16, 16),) * fp.num_layers, fingerprint=fp, budget_bytes=1,
                       context_length=ids.shape[1], scorer=scorer)
    cache = MoENDCache(plan, rope=rope, query_stats=[stats[i] for i in range(fp.num_layers)], budget_mode="ratio")
    model.set_attn_implementation("moend")
    try:
        model(input_ids=ids, cache=cache, use_cache=True)
    finally:
        model.set_attn_implementation("sdpa")
    for i in range(fp.num_layers):
        lc = cap.layers[i]
        sc = build_scorer(scorer, rope=rope, stats=stats[i])
        b, hkv, t, _ = lc.keys.shape
        kp = lc.key_positions[:, None, :].expand(b, hkv, t)
        scores = sc.score(lc.keys, lc.values, queries=lc.queries, key_positions=kp, query_positions=lc.query_positions)
        _, _, pos = kept_tokens(lc, scores, keep, SINK_TOKENS, RECENT_TOKENS)
        held = cache.layers[i].packed.positions.long()
        assert torch.equal(pos.sort(-1).values, held.sort(-1).values), (scorer, keep, i)
