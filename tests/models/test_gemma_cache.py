"""MoENDCache on the embedded Gemma 3 270M (slow; issue 55): its 15 sliding layers and 3 full ones under one plan.
The lossless plan gives ``DynamicCache``'s greedy tokens on three prompts (one inside the 512-token window, two past
it); a 14x plan (against Gemma's own hybrid 16-bit cache) answers a passkey at 4k with the measured cache at or under
its budget at every step."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList

from moend_fx.cache.generation import prepare, unprepare
from moend_fx.cache.moend_cache import MoENDCache
from moend_fx.calibration.tables import layer_query_stats
from moend_fx.eval.tasks.base import score
from moend_fx.eval.tasks.registry import make_examples
from moend_fx.eviction.rope import rope_from_model
from moend_fx.plan.memory import full_cache_bytes
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan
from moend_fx.solvers import GreedySolver
from tests.cache.budget_watch import BytesEveryStep

pytestmark = pytest.mark.slow


def _greedy(model, ids, n, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


def test_lossless_plan_gives_dynamic_cache_tokens_on_three_prompts(gemma3):
    model, tok = gemma3
    fp = ModelFingerprint.from_model(model)
    assert fp.sliding == tuple(i for i in range(18) if i not in (5, 11, 17)) and fp.sliding_window == 512
    prompts = ["The three primary colours are", *(ex.prompt_full for n in (768, 1200)
                                                 for ex in make_examples("passkey", tok, n, 1, seed=5))]
    plan = RoutingPlan.uniform(LayerConfig(1.0, 16, 16), fp, 2048)
    for text in prompts:
        ids = tok(text, return_tensors="pt").input_ids
        want = _greedy(model, ids, 12)
        prepare(model, plan)
        try:
            got = _greedy(model, ids, 12, return_dict_in_generate=True)
        finally:
            unprepare(model)
        assert torch.equal(got.sequences, want), tok.decode(got.sequences[0, ids.shape[1]:])
        held = got.cache.held_tokens()
        assert held[5] == ids.shape[1] + 11 and max(held[i] for i in fp.sliding) == min(ids.shape[1] + 11, 511)



def test_14x_plan_answers_a_passkey_at_4k_within_its_budget(gemma3):
    from moend_fx.calibration.pipeline import calibrate

    model, tok = gemma3
    table = calibrate(model, tok, tokens=1024, num_sequences=1)
    res = GreedySolver().solve(table, "14x", context_length=4096)
    plan, fp = res.plan, res.plan.fingerprint
    assert res.budget.bytes == full_cache_bytes(fp, 4096) // 14  # the hybrid 16-bit cache: 15 x 511 + 3 x 4096
    assert all(plan.layers[i].quantized or plan.layers[i].evicts for i in fp.sliding)  # 14x needs them all routed
    ex = make_examples("passkey", tok, 4096, 1, seed=0)[0]
    ids = tok(ex.prompt_full, return_tensors="pt").input_ids
    assert 3500 < ids.shape[1] <= 4096
    prepare(model, plan, table=table)
    try:
        cache = MoENDCache(plan, rope=rope_from_model(model), query_stats=layer_query_stats(table))  # as prepare's
        watch = BytesEveryStep(cache)
        out = _greedy(model, ids, 8, cache=cache, logits_processor=LogitsProcessorList([watch]))
    finally:
        unprepare(model)
    assert max(watch.seen) <= plan.budget_bytes
    assert cache.nbytes() == cache.model_bytes()
    assert score(ex, tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)) == 1.0
