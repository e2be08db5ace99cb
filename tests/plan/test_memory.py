import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moend_fx.common.errors import BudgetError
from moend_fx.plan.memory import (
    DEFAULT_KEEP_FLOOR,
    full_cache_bytes,
    keep_count,
    keep_floor,
    layer_bytes,
    layer_bytes_breakdown,
    parse_budget,
    plan_bytes,
    plan_layer_bytes,
)
from moend_fx.plan.routing import Grid, LayerConfig, ModelFingerprint, RoutingPlan
from moend_fx.storage.packed import PackedKV

SMOL = ModelFingerprint("LlamaForCausalLM", 30, 3, 64, 9, "float32")
CONFIGS = Grid(k_bits=(16, 8, 4, 2), v_bits=(16, 8, 4, 2)).configs


@given(
    config=st.sampled_from(CONFIGS), tokens=st.integers(1, 300), b=st.integers(1, 2), h=st.integers(1, 3),
    d=st.sampled_from([16, 32, 64]), g=st.sampled_from([8, 16, 32, 64]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 999),
)
def test_packed_storage_equals_memory_model_to_the_byte(config, tokens, b, h, d, g, dtype, seed):
    n = keep_count(tokens, config.keep_ratio)
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, n, d, generator=gen).to(dtype)
    v = torch.randn(b, h, n, d, generator=gen).to(dtype)
    pos = torch.arange(n).expand(b, h, n) if config.evicts else None
    layer = PackedKV.from_dense(k, v, config, g, pos)
    eb = torch.empty((), dtype=dtype).element_size()
    predicted = layer_bytes(config, tokens, kv_heads=h, head_dim=d, batch=b, group_size=g, dtype_bytes=eb)
    assert layer.nbytes() == predicted


def test_keep_count_rounding_and_clamp():
    assert keep_count(30, 0.1) == 3  # not 4: 0.1 * 30 is 3.0000000000000004 in floats
    assert keep_count(2048, 0.25) == 512
    assert keep_count(5, 0.1) == 1
    assert keep_count(7, 1.0) == 7
    assert keep_count(0, 0.5) == 0


def test_keep_count_floor():
    assert keep_count(6, 0.1, floor=36) == 6  # a short prompt: every token (fewer than the floor)
    assert keep_count(40, 0.1, floor=36) == 36
    assert keep_count(2048, 0.1, floor=36) == 205  # at a plan's own length the floor does not bind
    assert keep_count(7, 1.0, floor=36) == 7
    assert keep_count(0, 0.1, floor=36) == 0
    assert keep_count(40, 0.1) == 4  # no floor by default


@given(tokens=st.integers(0, 5000), keep=st.sampled_from([0.1, 0.25, 0.5, 0.75, 0.9, 1.0]),
       floor=st.integers(0, 100))
def test_keep_count_floor_is_max_of_ratio_and_clamped_floor(tokens, keep, floor):
    n = keep_count(tokens, keep, floor)
    assert n == max(keep_count(tokens, keep), min(tokens, floor))
    assert min(tokens, 1) <= n <= tokens


def test_plan_byte_predictions_use_the_plans_floor():
    plan = RoutingPlan.uniform(LayerConfig(0.1, 4, 4), SMOL, 2048)
    assert keep_floor(plan) == DEFAULT_KEEP_FLOOR == 36
    kw = dict(kv_heads=3, head_dim=64, dtype_bytes=4)
    for t in (6, 40):
        per = layer_bytes(LayerConfig(0.1, 4, 4), 0, kept=min(t, 36), **kw)
        assert plan_bytes(plan, t) == 30 * per
        assert plan_layer_bytes(LayerConfig(0.1, 4, 4), t, SMOL) == per
    # at the plan's own length nothing moves (205 > 36 kept tokens)
    assert plan_bytes(plan) == 30 * layer_bytes(LayerConfig(0.1, 4, 4), 2048, **kw)
    other = RoutingPlan.uniform(LayerConfig(0.1, 4, 4), SMOL, 2048, sink_tokens=2, recent_tokens=8)
    assert plan_bytes(other, 40) == 30 * layer_bytes(LayerConfig(0.1, 4, 4), 0, kept=10, **kw)


def test_uniform_prices_its_bytes_with_its_own_floor():
    # At 40 tokens the floor binds (keep 0.1 -> 4 tokens): 2 sinks + 8 recent keep 10 (all in the full-precision
    # residual window), the default floor 36 (32 of them packed).
    c = LayerConfig(0.1, 4, 4)
    default = RoutingPlan.uniform(c, SMOL, 40)
    other = RoutingPlan.uniform(c, SMOL, 40, sink_tokens=2, recent_tokens=8)
    assert default.budget_bytes == default.bytes_planned == plan_bytes(default)
    assert other.budget_bytes == other.bytes_planned == plan_bytes(other) != default.budget_bytes
    kw = dict(kv_heads=3, head_dim=64, dtype_bytes=4)
    assert plan_bytes(other) == 30 * layer_bytes(c, 0, kept=10, **kw)


def test_lossless_layer_is_plain_cache_size():
    b = layer_bytes(LayerConfig(1.0, 16, 16), 2048, kv_heads=3, head_dim=64, dtype_bytes=4)
    assert b == full_cache_bytes(SMOL, 2048, dtype=None) // 30


def test_full_cache_bases_match_design_md():
    # design.md: SmolLM2 ~1950 tokens -> full fp32 cache 91.4 MB, 16-bit 45.7 MB
    assert full_cache_bytes(SMOL, 1983, dtype=None) == pytest.approx(91.4e6, rel=0.01)
    assert full_cache_bytes(SMOL, 1983) == pytest.approx(45.7e6, rel=0.01)


def test_breakdown_parts():
    parts = layer_bytes_breakdown(LayerConfig(0.5, 4, 8), 100, kv_heads=1, head_dim=64, group_size=32)
    # n = 50 -> P = 32 packed, R = 18 residual
    assert parts["k_codes"] == 32 * 64 // 2
    assert parts["v_codes"] == 32 * 64
    assert parts["scales"] == (1 * 64 + 32 * 2) * 2 * 2
    assert parts["residual"] == 2 * 18 * 64 * 4
    assert parts["positions"] == 50 * 4


def test_parse_budget_forms():
    full16 = full_cache_bytes(SMOL, 2048)
    assert parse_budget("14x", SMOL, 2048).bytes == int(full16 / 14)
    assert "16-bit" in parse_budget("14x", SMOL, 2048).base
    assert parse_budget("136MB", SMOL, 2048).bytes == 136_000_000
    assert parse_budget("1.5GiB", SMOL, 2048).bytes == int(1.5 * 2**30)
    assert parse_budget(3_300_000, SMOL, 2048).bytes == 3_300_000
    assert parse_budget("3.3 mb", SMOL, 2048).bytes == 3_300_000


@pytest.mark.parametrize("bad", ["", "abc", "14y", "-3MB", "0.5x", "12 parsecs", 0, -5, True, 1.5, None])
def test_bad_budgets(bad):
    with pytest.raises(BudgetError):
        parse_budget(bad, SMOL, 2048)


def test_plan_bytes_uniform():
    plan = RoutingPlan.uniform(LayerConfig(0.25, 4, 4), SMOL, 2048)
    assert plan.budget_bytes == plan_bytes(plan) == plan.bytes_planned
    assert plan_bytes(plan) < full_cache_bytes(SMOL, 2048) / 10
