"""Each setting of a run compresses with its own table and scorer (or one table for all), and says so."""

from __future__ import annotations

import pytest
import torch

from moend_fx.calibration.pipeline import calibrate
from moend_fx.common.errors import MoendError
from moend_fx.eval.config import EvalConfig
from moend_fx.eval.runner import Runner
from moend_fx.eval.setting_plans import per_setting, setting_plans
from moend_fx.models import tiny_model
from tests.eval.test_runner import TOK


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, seed=1)


@pytest.fixture(scope="module")
def tables(model):
    ids = torch.randint(0, 256, (1, 256), generator=torch.Generator().manual_seed(0))
    return {"query_aware": calibrate(model, token_ids=ids, scorer="snapkv_trig"),
            "query_agnostic": calibrate(model, token_ids=ids, scorer="trig")}


def test_each_setting_records_the_setting_its_table_was_made_for(tables):
    assert tables["query_aware"].calibration["setting"] == "query_aware"
    assert tables["query_agnostic"].calibration["setting"] == "query_agnostic"


def test_each_setting_plans_and_scores_with_its_own_table(model, tables, tmp_path):
    cfg = EvalConfig(tasks=("passkey",), lengths=(300,), n=1, budgets=("8x",), methods=("full", "2d_hetero"),
                     max_new_tokens=4)
    sp = setting_plans(model, tables, cfg)
    assert sp["query_aware"].scorer == "snapkv_trig" and sp["query_agnostic"].scorer == "trig"
    assert sp["query_aware"].plans is not sp["query_agnostic"].plans
    res = Runner(model, TOK, tables, cfg, progress=False).run(tmp_path)
    assert {k.split("|")[0] for k in res.plans} == {"query_aware", "query_agnostic"}  # plans keyed by setting
    assert res.meta["settings"]["query_aware"]["scorer"] == "snapkv_trig"
    assert res.meta["settings"]["query_agnostic"]["table"]["scorer"] == "trig"
    for r in res.records:
        if r["method"] == "2d_hetero":
            assert r["measured_bytes"] <= r["budget_bytes"], r  # each plan priced for its own scorer's state


def test_one_table_serves_every_setting_and_shares_its_plans(model, tables):
    cfg = EvalConfig(budgets=("8x",), methods=("2d_hetero",))
    sp = setting_plans(model, tables["query_agnostic"], cfg)
    assert sp["query_aware"] is sp["query_agnostic"]


def test_missing_or_bad_tables_are_named(tables):
    with pytest.raises(MoendError, match=r"no table for setting\(s\) \['query_agnostic'\]"):
        per_setting({"query_aware": tables["query_aware"]}, ("query_aware", "query_agnostic"))
    with pytest.raises(MoendError, match="setting='later' is unknown"):
        per_setting({"later": tables["query_aware"]}, ("query_aware",))
    with pytest.raises(MoendError, match=r"tables\['query_aware'\] must be a SensitivityTable; got str"):
        per_setting({"query_aware": "t.safetensors"}, ("query_aware",))


def test_the_re_eviction_granularity_and_budget_mode_reach_every_cache_of_a_run(model, tables):
    cfg = EvalConfig(tasks=("passkey",), lengths=(300,), n=1, budgets=("8x",), methods=("2d_hetero",),
                     reevict="tokens", budget_mode="ratio")
    assert cfg.to_dict()["reevict"] == "tokens" and cfg.to_dict()["budget_mode"] == "ratio"
    from moend_fx.cache.moend_cache import MoENDCache

    sp = setting_plans(model, tables, cfg)["query_aware"]
    plan = sp.plans.get("2d_hetero", "8x", 300).plan
    cache = MoENDCache(plan, **sp.moend_kw)
    assert all(not layer.policy.whole_groups and not layer.policy.capped for layer in cache.layers)
    assert all(layer.policy.whole_groups for layer in MoENDCache(plan).layers)  # the default: whole groups
    with pytest.raises(MoendError, match="reevict='bits' is unknown; allowed: groups, tokens"):
        EvalConfig(reevict="bits")
    with pytest.raises(MoendError, match="budget_mode='cap' is unknown; allowed: ratio, capacity"):
        EvalConfig(budget_mode="cap")
