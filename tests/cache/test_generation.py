"""moend_fx.cache.generation.prepare: generate builds a fresh MoENDCache per call without the user building it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from moend_fx.cache.generation import prepare, unprepare
from moend_fx.cache.moend_cache import MoENDCache
from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.calibration.stats_arrays import stats_to_arrays
from moend_fx.common.errors import MoendError, PlanError
from moend_fx.eviction.query_stats import QueryStats
from moend_fx.eviction.rope import rope_from_model
from moend_fx.models import tiny_model
from moend_fx.plan.memory import plan_bytes
from moend_fx.plan.routing import Grid, LayerConfig, ModelFingerprint, RoutingPlan


def _model(**kw):
    return tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, **kw)


def _plan(model, cfg, calibrated: bool = True) -> RoutingPlan:
    """A uniform plan for 256 tokens, priced for caches with calibrated query statistics (a table's) or without
    (prepare refuses a cache whose eviction state costs more than the plan was priced for)."""
    plan = RoutingPlan.uniform(cfg, ModelFingerprint.from_model(model), 256)
    used = plan_bytes(plan, calibrated=calibrated)
    return dataclasses.replace(plan, budget_bytes=used, bytes_planned=used)


def _ids(t: int = 30) -> torch.Tensor:
    return torch.randint(3, 256, (1, t), generator=torch.Generator().manual_seed(0))


def _gen(model, **kw):
    return model.generate(_ids(), max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0, **kw)


def test_prepare_builds_a_fresh_cache_per_generate_call():
    model = _model()
    ref = _gen(model)
    assert prepare(model, _plan(model, LayerConfig(1.0, 16, 16))) is model
    assert model.config._attn_implementation == "moend"
    out = _gen(model, return_dict_in_generate=True)
    assert isinstance(out.cache, MoENDCache)
    assert torch.equal(out.sequences, ref)
    again = _gen(model, return_dict_in_generate=True)
    assert again.cache is not out.cache and torch.equal(again.sequences, ref)


def test_prepare_passes_options_and_respects_a_user_cache():
    model = _model()
    prepare(model, _plan(model, LayerConfig(0.5, 4, 8), calibrated=False), evict_every=4, scorer="snapkv")
    out = _gen(model, return_dict_in_generate=True)
    assert out.cache.layers[0].policy.evict_every == 4
    assert out.cache.layers[0].scorer.name == "snapkv"
    assert out.cache.nbytes() == out.cache.model_bytes()
    mine = MoENDCache(_plan(model, LayerConfig(1.0, 16, 16)))
    out = _gen(model, cache=mine, return_dict_in_generate=True)
    assert out.cache is mine
    out = _gen(model, cache=DynamicCache(config=model.config), return_dict_in_generate=True)
    assert isinstance(out.cache, DynamicCache)  # "moend" attention falls back to SDPA for other caches


def test_unprepare_restores_the_model():
    model = _model()
    ref = _gen(model, return_dict_in_generate=True)
    prepare(model, _plan(model, LayerConfig(0.25, 4, 4), calibrated=False))
    unprepare(model)
    assert model.config._attn_implementation == "sdpa"
    out = _gen(model, return_dict_in_generate=True)
    assert isinstance(out.cache, DynamicCache) and torch.equal(out.sequences, ref.sequences)


def test_prepare_rejects_a_plan_for_another_model_and_bad_options():
    model = _model()
    other = tiny_model("llama", num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(PlanError, match="num_layers"):
        prepare(model, _plan(other, LayerConfig(1.0, 16, 16)))
    with pytest.raises(MoendError, match="budget_mode"):
        prepare(model, _plan(model, LayerConfig(0.5, 4, 4)), budget_mode="nope")
    with pytest.raises(MoendError, match="RoutingPlan"):
        prepare(model, {"layers": []})
    assert model.config._attn_implementation == "sdpa"  # nothing changed on failure


def test_prepare_feeds_calibrated_query_stats_from_a_table():
    model = _model()
    fp = ModelFingerprint.from_model(model)
    stats = stats_to_arrays({
        layer: QueryStats.empty(fp.num_heads, fp.head_dim).accumulate(torch.randn(1, fp.num_heads, 8, fp.head_dim))
        for layer in range(fp.num_layers)
    })
    grid = Grid()
    table = SensitivityTable(np.zeros((fp.num_layers, len(grid))), grid, fp, query_stats=stats)
    prepare(model, _plan(model, LayerConfig(0.5, 4, 4)), table=table)
    out = _gen(model, return_dict_in_generate=True)
    sc = out.cache.layers[1].scorer
    assert sc.name == "trig" and sc.stats is not None
    assert out.cache.layers[1].evictor.window.nbytes() == 0  # calibrated stats: no query window kept
    assert out.cache.layers[1].state_nbytes() == sc.stats.nbytes() + 8  # the stats and one row's RoPE offset
    assert sc.rope == rope_from_model(model)


def test_prepare_installs_the_compile_hooks_and_unprepare_removes_them():
    from moend_fx.compile.settings import BackendSettings

    model = _model()
    plan = _plan(model, LayerConfig(0.5, 4, 8))
    prepare(model, plan, scorer="keynorm")
    hooks = ("_prepare_cache_for_generation", "prepare_inputs_for_generation", "_prefill", "generate", "moend_plan")
    assert all(name in model.__dict__ for name in hooks)
    assert BackendSettings(plan=model).plan is plan  # the backend finds the plan on a prepared model
    unprepare(model)
    assert not any(name in model.__dict__ for name in hooks)


def test_generate_calls_before_step_once_per_forward(monkeypatch):
    calls = []
    original = MoENDCache.before_step

    def spy(self):
        calls.append(self.get_seq_length())
        original(self)

    monkeypatch.setattr(MoENDCache, "before_step", spy)
    model = _model()
    prepare(model, _plan(model, LayerConfig(0.5, 4, 8)), scorer="keynorm")
    _gen(model)
    # Before the prefill (empty cache), then before each of the 19 decode steps (20 tokens: the last is sampled
    # from the 19th step's logits).
    assert calls == [0, *range(30, 30 + 19)]


def test_decode_compile_settings_are_scoped():
    import torch.fx.experimental._config as fx_config

    from moend_fx.cache.generation import decode_compile_settings

    before = torch.compiler.config.dynamic_sources
    with decode_compile_settings():
        assert "logical" in torch.compiler.config.dynamic_sources and fx_config.backed_size_oblivious
    assert torch.compiler.config.dynamic_sources == before and not fx_config.backed_size_oblivious


def test_prepare_rejects_a_bad_compile_prefill():
    model = _model()
    with pytest.raises(MoendError, match="compile_prefill='yes' is invalid; allowed: True or False"):
        prepare(model, _plan(model, LayerConfig(1.0, 16, 16)), compile_prefill="yes")


def test_package_level_prepare_stays_the_function_after_any_import():
    # Regression: a submodule named like the function used to replace `moend_fx.prepare` with the module
    # after its first import, so a second `moend_fx.prepare(model, plan)` raised "module is not callable".
    import moend_fx
    import moend_fx.cache.generation  # noqa: F401

    assert moend_fx.prepare is prepare and callable(moend_fx.prepare)
    assert moend_fx.unprepare is unprepare
