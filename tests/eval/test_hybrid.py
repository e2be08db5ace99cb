"""The one-prefill evaluation on a sliding-window hybrid (a tiny random-weight Gemma 3, window 24 against prompts of
hundreds of tokens, so its sliding layers drop tokens): the full method gives ``generate``'s tokens over
``DynamicCache(config)``, a MoE-nD plan built from the prefill gives ``moend_fx.prepare`` + ``generate``'s tokens
with that plan, the uniform baselines at matched bytes are priced by the one memory model (sliding layers by their
window), and every budgeted cache holds at most its budget after every forward pass."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from moend_fx.cache.generation import prepare, unprepare
from moend_fx.calibration.pipeline import calibrate
from moend_fx.common.defaults import QUERY_WINDOW
from moend_fx.eval.config import EvalConfig
from moend_fx.eval.methods import METHODS, build_cache, cache_nbytes, moend_options
from moend_fx.eval.plan_book import PlanBook
from moend_fx.eval.runner import Runner
from moend_fx.eval.steps import EVAL_ATTN, greedy_decode, prefill
from moend_fx.eval.tasks.registry import make_examples
from moend_fx.plan.memory import full_cache_bytes, plan_bytes
from moend_fx.plan.routing import ModelFingerprint
from tests.cache.sliding_models import WINDOW, sliding_model
from tests.eval.test_runner import TOK


@pytest.fixture(scope="module")
def model():
    return sliding_model("gemma3_text", seed=3)


@pytest.fixture(scope="module")
def table(model):
    ids = torch.randint(0, 256, (1, 256), generator=torch.Generator().manual_seed(0))
    return calibrate(model, token_ids=ids)


@pytest.fixture(scope="module")
def example():
    return make_examples("passkey", TOK, 300, n=1, seed=5)[0]


def _ids(ex, setting):
    return TOK(ex.prefill_text(setting))["input_ids"], TOK(ex.suffix_text(setting))["input_ids"]


def _generate(model, ids, n, **kw):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, **kw)
    return out[0, ids.shape[1]:].tolist()


def test_the_prefill_keeps_every_layers_tokens_and_the_full_method_keeps_the_window(model, example):
    ctx, _ = _ids(example, "query_aware")
    state = prefill(model, ctx)
    assert [k.shape[2] for k, _ in state.kv] == [len(ctx)] * len(state.kv)
    ref = DynamicCache(config=model.config)  # what a plain prefill leaves
    with torch.no_grad():
        model(input_ids=torch.tensor([ctx]), cache=ref, use_cache=True)
    full = build_cache(METHODS["full"], state, model=model)
    fp = ModelFingerprint.from_model(model)
    assert fp.sliding and len(ctx) > 4 * WINDOW
    for i, (ours, want) in enumerate(zip(full.layers, ref.layers)):
        assert ours.keys.shape[2] == fp.layer_tokens(i, len(ctx))  # window - 1 on a sliding layer
        # one prefill through the same masks: the same K/V, bit for bit (the model's own attention both times)
        assert torch.equal(ours.keys, want.keys) and torch.equal(ours.values, want.values)
    assert cache_nbytes(full) == 2 * full_cache_bytes(fp, len(ctx))  # fp32: twice the hybrid 16-bit cache


def test_full_method_equals_generate_over_the_hybrid_dynamic_cache(model, example):
    ctx, suffix = _ids(example, "query_agnostic")
    with torch.no_grad():
        model.set_attn_implementation(EVAL_ATTN)
        try:
            ours, why = greedy_decode(model, build_cache(METHODS["full"], prefill(model, ctx), model=model),
                                      suffix, 2 * WINDOW)
        finally:
            model.set_attn_implementation("sdpa")
    assert why == "max_new_tokens"
    ids = torch.tensor([ctx + suffix])
    assert ours == _generate(model, ids, 2 * WINDOW, cache=DynamicCache(config=model.config))


def test_a_moend_plan_from_the_prefill_equals_prepare_and_generate(model, table, example):
    head, suffix = _ids(example, "query_aware")  # the question is prefilled; the answer prefix is fed after it
    plan = PlanBook(table).get("2d_hetero", "4x", len(head)).plan
    assert plan is not None and any(c.evicts for c in plan.layers)
    assert {c.name for i, c in enumerate(plan.layers) if plan.fingerprint.is_sliding(i)} != {"keep1.0_k16_v16"}
    kw = moend_options(model, table, window=QUERY_WINDOW)
    model.set_attn_implementation(EVAL_ATTN)
    try:
        cache = build_cache(METHODS["2d_hetero"], prefill(model, head), model=model, plan=plan, **kw)
        ours, _ = greedy_decode(model, cache, suffix, 2 * WINDOW)
    finally:
        model.set_attn_implementation("sdpa")
    prepare(model, plan, table=table, prefill_chunk=None)
    try:
        # a user's two turns: generate over the head leaves its MoENDCache (the one generated token is not fed
        # back), then generate over head + suffix feeds the suffix through that cache and decodes
        with torch.no_grad():
            first = model.generate(torch.tensor([head]), max_new_tokens=1, do_sample=False, pad_token_id=0,
                                   return_dict_in_generate=True)
        want = _generate(model, torch.tensor([head + suffix]), 2 * WINDOW, cache=first.cache)
    finally:
        unprepare(model)
    assert ours == want


@pytest.mark.parametrize("budget", ["4x", "8x"])
def test_matched_uniform_plans_are_priced_by_the_one_memory_model(table, budget):
    T = 300
    book = PlanBook(table)
    matched = book.get("2d_uniform_matched", budget, T)
    grid = book.get("2d_uniform", budget, T)
    assert matched.plan is not None and grid.plan is not None
    # sliding layers are priced by their window: the plan's own bytes, not layers x a full layer's
    assert matched.plan.bytes_planned == plan_bytes(matched.plan, T) <= matched.budget_bytes
    assert plan_bytes(grid.plan, T) <= plan_bytes(matched.plan, T)
    assert matched.plan.layers[0].keep_ratio >= grid.plan.layers[0].keep_ratio


def test_every_budgeted_cache_holds_its_budget_at_every_step(model, table, tmp_path):
    cfg = EvalConfig(tasks=("passkey",), lengths=(300,), n=2, budgets=("4x", "8x"), settings=("query_aware",),
                     methods=("full", "2d_uniform", "2d_uniform_matched", "2d_hetero"), max_new_tokens=12)
    recs = Runner(model, TOK, table, cfg, progress=False).run(tmp_path).records
    assert {r["method"] for r in recs} == set(cfg.methods)
    fp = ModelFingerprint.from_model(model)
    for r in recs:
        assert r["full16_bytes"] == full_cache_bytes(fp, r["context_tokens"])  # the hybrid 16-bit cache
        if r["budget"] is not None:
            assert r["peak_bytes"] <= r["budget_bytes"], r
        else:  # the full hybrid cache in fp32: twice the 16-bit one after the prompt, then the suffix's tokens
            assert r["measured_bytes"] == 2 * r["full16_bytes"]


def test_the_banded_prefill_attention_equals_the_dense_one(model, example, monkeypatch):
    import moend_fx.eval.steps as steps

    ctx, _ = _ids(example, "query_aware")
    dense = prefill(model, ctx)
    monkeypatch.setattr(steps, "BAND_ROWS", 40)  # rows > 40: every sliding layer's prefill runs in bands
    calls = []
    inner = steps.banded_attention
    monkeypatch.setattr(steps, "banded_attention", lambda *a, **k: calls.append(1) or inner(*a, **k))
    banded = prefill(model, ctx)
    assert len(calls) >= 5  # the five sliding layers at least (a full layer's mask may be None: flash SDPA)
    for (k1, v1), (k2, v2), q1, q2 in zip(dense.kv, banded.kv, dense.queries, banded.queries):
        # the columns a band leaves out are masked for all its rows (exp(-inf) = 0): only the sums' order differs
        torch.testing.assert_close(k2, k1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v2, v1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(q2, q1, atol=1e-5, rtol=1e-5)
    assert not torch.equal(dense.kv[-1][0], torch.zeros_like(dense.kv[-1][0]))


def test_transformers_quantized_cache_is_skipped_on_a_hybrid_with_its_reason(model, table):
    cfg = EvalConfig(tasks=("passkey",), lengths=(300,), n=1, budgets=("4x",), settings=("query_aware",),
                     methods=("full", "hf_fp8"))
    runner = Runner(model, TOK, table, cfg, progress=False)
    assert runner.methods == ["full"]
    assert "only full-attention models" in runner.skipped["hf_fp8"] and "5 sliding-window" in runner.skipped["hf_fp8"]
