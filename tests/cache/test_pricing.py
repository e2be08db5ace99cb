"""prepare keeps the plan's budget whatever it is given: a cache with another eviction state than the plan was priced
for (no table=, another scorer=, a larger window=) is refused before generation with one error that names the option
and how to re-solve; a plan priced for the cache prepare builds holds its budget at every step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LogitsProcessorList

import moend_fx.cache.generation as generation
from moend_fx import get_solver
from moend_fx.cache.generation import prepare, unprepare
from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.calibration.stats_arrays import stats_to_arrays
from moend_fx.common.errors import BudgetError
from moend_fx.eviction.query_stats import QueryStats
from moend_fx.models import tiny_model
from moend_fx.plan.routing import Grid, LayerConfig, ModelFingerprint, RoutingPlan
from tests.cache.budget_watch import BytesEveryStep, record_caches

CONTEXT = 512
NEW = 40


def _model():
    return tiny_model("llama", num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16)


def _table(model) -> SensitivityTable:
    """A table with calibrated query statistics (random queries) and a random S: what a solver routes by."""
    fp = ModelFingerprint.from_model(model)
    gen = torch.Generator().manual_seed(0)
    stats = stats_to_arrays({
        layer: QueryStats.empty(fp.num_heads, fp.head_dim).accumulate(
            torch.randn(1, fp.num_heads, 8, fp.head_dim, generator=gen))
        for layer in range(fp.num_layers)})
    grid = Grid()
    # less kept and fewer bits cost more loss (so the greedy solver spends the budget), plus per-layer noise
    cost = np.array([(1.0 - c.keep_ratio) + (16 - c.k_bits) / 16 + (16 - c.v_bits) / 32 for c in grid.configs])
    s = cost[None, :] * np.random.default_rng(0).uniform(0.5, 1.5, (fp.num_layers, 1))
    return SensitivityTable(s, grid, fp, query_stats=stats)



def _bytes_per_step(model, monkeypatch) -> list[int]:
    made = record_caches(monkeypatch)
    watch = BytesEveryStep(made)
    ids = torch.randint(3, 256, (1, CONTEXT - 8), generator=torch.Generator().manual_seed(1))
    model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
                   logits_processor=LogitsProcessorList([watch]))
    return watch.seen


def test_prepare_without_the_table_is_refused_before_generation_and_names_the_fix():
    model = _model()
    table = _table(model)
    plan = get_solver("greedy").solve(table, "4x", context_length=CONTEXT).plan
    with pytest.raises(BudgetError) as err:
        prepare(model, plan)
    msg = str(err.value)
    assert "no table=" in msg and "pass table=" in msg
    assert f"table.priced_for('trig', calibrated=False), {plan.budget_bytes}, context_length={CONTEXT}" in msg
    assert model.config._attn_implementation == "sdpa"  # refused before anything changed


def test_another_scorer_or_a_larger_window_is_refused_and_named():
    model = _model()
    table = _table(model)
    plan = get_solver("greedy").solve(table, "4x", context_length=CONTEXT).plan
    with pytest.raises(BudgetError, match=r"scorer='snapkv' \(the plan was solved for 'trig'\)") as err:
        prepare(model, plan, table=table, scorer="snapkv")
    assert "priced_for('snapkv', calibrated=False)" in str(err.value)
    prepare(model, plan, table=table, window=64)  # calibrated trig reads no queries: the window costs nothing
    snap = get_solver("greedy").solve(table.priced_for("snapkv", calibrated=False), "4x",
                                      context_length=CONTEXT).plan
    assert snap.scorer == "snapkv"  # a plan records the scorer it was priced for: prepare builds that one
    prepare(model, snap)
    assert {layer.scorer.name for layer in generation.MoENDCache(snap).layers if layer.scorer} == {"snapkv"}
    with pytest.raises(BudgetError, match="window=64 \\(plans are priced with the default window=32\\)"):
        prepare(model, snap, scorer="snapkv", window=64)
    unprepare(model)


def test_the_plan_priced_for_the_cache_keeps_its_budget_at_every_step(monkeypatch):
    """With the table (the state the plan was priced for), and with a plan re-solved for snapkv as the error says:
    the measured bytes stay at or under the budget after the prompt and after every decode step."""
    model = _model()
    table = _table(model)
    cases = [(get_solver("greedy").solve(table, "4x", context_length=CONTEXT).plan, {}),
             (get_solver("greedy").solve(table.priced_for("snapkv", calibrated=False), "4x",
                                         context_length=CONTEXT).plan, {"scorer": "snapkv"})]
    try:
        for plan, kw in cases:
            assert any(c.evicts for c in plan.layers)  # eviction state is part of the price
            prepare(model, plan, table=table, **kw)
            seen = _bytes_per_step(model, monkeypatch)
            assert len(seen) == NEW and max(seen) <= plan.budget_bytes, (kw, max(seen), plan.budget_bytes)
    finally:
        unprepare(model)


def test_a_cheaper_state_and_a_plan_without_a_price_are_not_refused():
    model = _model()
    table = _table(model)
    plan = get_solver("greedy").solve(table, "4x", context_length=CONTEXT).plan
    prepare(model, plan, table=table, scorer="keynorm")  # no statistics, no query window: cheaper than priced
    fp = ModelFingerprint.from_model(model)
    unpriced = RoutingPlan(layers=(LayerConfig(0.5, 4, 4),) * fp.num_layers, fingerprint=fp, budget_bytes=1,
                           context_length=CONTEXT)
    prepare(model, unpriced)  # built field by field: states no price, promises no budget
    unprepare(model)


@pytest.mark.slow
def test_smollm2_the_two_reproductions_are_refused_and_the_priced_plans_keep_their_budget(smollm2, monkeypatch):
    """Issue 55's reproductions on SmolLM2 with a greedy 14x plan for 2048 tokens: without table= it held 19% over
    its budget after the prompt, with scorer="snapkv" 27% over within 200 new tokens. Both are now refused before
    generation; with the table, and with the plan re-solved for snapkv as the error says, the measured bytes stay
    at or under the budget after the prompt and every decode step. (The table is calibrated on 512 tokens, ~4x
    cheaper than 2048: bytes do not depend on S, only which plan the solver picks.)"""
    from moend_fx import calibrate
    from moend_fx.eval.tasks import make_examples

    model, tok = smollm2
    table = calibrate(model, tok, tokens=512)
    plan = get_solver("greedy").solve(table, "14x", context_length=2048).plan
    with pytest.raises(BudgetError, match="no table="):
        prepare(model, plan)
    with pytest.raises(BudgetError, match="scorer='snapkv'"):
        prepare(model, plan, table=table, scorer="snapkv")
    assert model.config._attn_implementation != "moend"
    snap = get_solver("greedy").solve(table.priced_for("snapkv", calibrated=False), "14x", context_length=2048).plan
    made = record_caches(monkeypatch)
    try:
        for p, kw, length, new in ((plan, {}, 2048, 8), (snap, {"scorer": "snapkv"}, 1900, 32)):
            ex = make_examples("passkey", tok, length, 1, seed=3)[0]
            ids = tok(ex.prompt_full, return_tensors="pt")
            prepare(model, p, table=table, **kw)
            watch = BytesEveryStep(made)
            with torch.inference_mode():
                model.generate(**ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                               logits_processor=LogitsProcessorList([watch]), pad_token_id=tok.eos_token_id)
            assert len(watch.seen) == new and max(watch.seen) <= p.budget_bytes, (kw, max(watch.seen), p.budget_bytes)
    finally:
        unprepare(model)
