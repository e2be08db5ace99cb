import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moend_fx.common.errors import BudgetError
from moend_fx.common.options import ScorerName
from moend_fx.plan.memory import (
    DEFAULT_KEEP_FLOOR,
    PARTS,
    full_cache_bytes,
    keep_count,
    keep_floor,
    layer_bytes,
    layer_bytes_breakdown,
    parse_budget,
    plan_bytes,
    plan_layer_bytes,
    plan_layer_parts,
    plan_parts,
)
from moend_fx.plan.routing import Grid, LayerConfig, ModelFingerprint, RoutingPlan
from moend_fx.plan.scorer_state import scorer_state_bytes
from moend_fx.storage.packed import PackedKV

SMOL = ModelFingerprint("LlamaForCausalLM", 30, 3, 64, 9, "float32")
CONFIGS = Grid(k_bits=(16, 8, 4, 2), v_bits=(16, 8, 4, 2)).configs


@given(
    config=st.sampled_from(CONFIGS), tokens=st.integers(1, 300), b=st.integers(1, 2), h=st.integers(1, 3),
    d=st.sampled_from([16, 32, 64]), g=st.sampled_from([8, 16, 32, 64]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), seed=st.integers(0, 999),
)
def test_packed_storage_equals_memory_model_to_the_byte(config, tokens, b, h, d, g, dtype, seed):
    n = keep_count(tokens, config.keep_ratio)
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, n, d, generator=gen).to(dtype)
    v = torch.randn(b, h, n, d, generator=gen).to(dtype)
    # the newest slots are kept (as the recent window is): positions end at tokens - 1
    pos = torch.arange(tokens - n, tokens).expand(b, h, n) if config.evicts else None
    layer = PackedKV.from_dense(k, v, config, g, pos)
    predicted = layer_bytes(config, tokens, kv_heads=h, head_dim=d, batch=b, group_size=g, dtype=dtype)
    assert layer.nbytes() == predicted


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", torch.float32])
def test_raw_storage_costs_two_bytes_whatever_the_model_dtype(dtype):
    """16-bit sides and the residual are stored in 16 bits: the model's dtype moves no byte (issue 12)."""
    c = LayerConfig(0.5, 16, 4)
    parts = layer_bytes_breakdown(c, 100, kv_heads=1, head_dim=64, dtype=dtype)
    # K: 32 packed (raw) + 18 residual tokens, 2 bytes an element; V (4-bit) is packed on arrival: no residual
    assert parts["k_codes"] == 32 * 64 * 2 and parts["residual"] == 18 * 64 * 2
    assert layer_bytes(c, 100, kv_heads=1, head_dim=64, dtype=dtype) == sum(parts.values())


@pytest.mark.parametrize("tokens, position_bytes", [(32767, 2), (32768, 2), (32769, 4), (70000, 4)])
def test_position_bytes_follow_the_context(tokens, position_bytes):
    """int16 positions while the layer's slots fit (largest position 32767), int32 past that."""
    c = LayerConfig(0.1, 4, 4)
    n = keep_count(tokens, 0.1)
    assert layer_bytes_breakdown(c, tokens, kv_heads=3, head_dim=64)["positions"] == 3 * n * position_bytes
    assert layer_bytes_breakdown(c, 0, kv_heads=3, head_dim=64, kept=n, slots=tokens)["positions"] == (
        3 * n * position_bytes)
    k = torch.zeros(1, 1, n, 16)
    layer = PackedKV.from_dense(k, k, c, 32, torch.arange(tokens - n, tokens).expand(1, 1, n))
    assert layer.nbytes() == layer_bytes(c, tokens, kv_heads=1, head_dim=16)


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
    kw = dict(kv_heads=3, head_dim=64)
    # calibrated trig (the plan's scorer): 9 heads x 32 frequencies x 3 float64 of statistics + 1 int64 RoPE offset
    state = 9 * 32 * 3 * 8 + 8
    assert scorer_state_bytes(LayerConfig(0.1, 4, 4), 6, scorer="trig", num_heads=9, head_dim=64) == state
    for t in (6, 40):
        per = layer_bytes(LayerConfig(0.1, 4, 4), 0, kept=min(t, 36), **kw) + state
        assert plan_bytes(plan, t) == 30 * per
        assert plan_layer_bytes(LayerConfig(0.1, 4, 4), t, SMOL) == per
    # at the plan's own length nothing moves (205 > 36 kept tokens)
    assert plan_bytes(plan) == 30 * (layer_bytes(LayerConfig(0.1, 4, 4), 2048, **kw) + state)
    other = RoutingPlan.uniform(LayerConfig(0.1, 4, 4), SMOL, 2048, sink_tokens=2, recent_tokens=8)
    assert plan_bytes(other, 40) == 30 * (layer_bytes(LayerConfig(0.1, 4, 4), 0, kept=10, **kw) + state)


def test_eviction_state_bytes_by_scorer():
    cfg, kw = LayerConfig(0.5, 4, 4), dict(num_heads=9, head_dim=64, batch=2)
    assert scorer_state_bytes(LayerConfig(1.0, 4, 4), 100, scorer="snapkv", **kw) == 0  # keeps every token
    assert scorer_state_bytes(cfg, 100, scorer=None, **kw) == 0
    assert scorer_state_bytes(cfg, 100, scorer="keynorm", **kw) == 16  # two rows' RoPE offsets only
    # a query window: 2 rows x 9 heads x W queries x 64 channels in 16 bits, W int32 slots, 2 x W int32 positions
    for seen, w in ((10, 10), (100, 32)):
        window = 2 * 9 * w * 64 * 2 + w * 4 + 2 * w * 4
        assert scorer_state_bytes(cfg, seen, scorer="snapkv", **kw) == 16 + window
        assert scorer_state_bytes(cfg, seen, scorer="trig", calibrated=False, **kw) == 16 + window
    assert scorer_state_bytes(cfg, 100, scorer="snapkv", window=8, **kw) == 16 + 2 * 9 * 8 * 128 + 32 + 64


def test_uniform_prices_its_bytes_with_its_own_floor():
    # At 40 tokens the floor binds (keep 0.1 -> 4 tokens): 2 sinks + 8 recent keep 10 (all in the full-precision
    # residual window), the default floor 36 (32 of them packed).
    c = LayerConfig(0.1, 4, 4)
    default = RoutingPlan.uniform(c, SMOL, 40)
    other = RoutingPlan.uniform(c, SMOL, 40, sink_tokens=2, recent_tokens=8)
    assert default.budget_bytes == default.bytes_planned == plan_bytes(default)
    assert other.budget_bytes == other.bytes_planned == plan_bytes(other) != default.budget_bytes
    kw = dict(kv_heads=3, head_dim=64)
    state = 9 * 32 * 3 * 8 + 8  # calibrated trig's statistics + one RoPE offset per evicting layer
    assert plan_bytes(other) == 30 * (layer_bytes(c, 0, kept=10, **kw) + state)


def test_lossless_layer_is_a_16_bit_cache_whatever_the_model_dtype():
    """keep1_k16_v16 of an fp32 model costs exactly the 16-bit base budgets are measured against (1x)."""
    b = layer_bytes(LayerConfig(1.0, 16, 16), 2048, kv_heads=3, head_dim=64, dtype="float32")
    assert b == full_cache_bytes(SMOL, 2048) // 30 == full_cache_bytes(SMOL, 2048, dtype=None) // 60
    assert plan_layer_bytes(LayerConfig(1.0, 16, 16), 2048, SMOL) == b


def test_full_cache_bases_match_design_md():
    # design.md: SmolLM2 ~1950 tokens -> full fp32 cache 91.4 MB, 16-bit 45.7 MB
    assert full_cache_bytes(SMOL, 1983, dtype=None) == pytest.approx(91.4e6, rel=0.01)
    assert full_cache_bytes(SMOL, 1983) == pytest.approx(45.7e6, rel=0.01)


def test_breakdown_parts():
    parts = layer_bytes_breakdown(LayerConfig(0.5, 4, 8), 100, kv_heads=1, head_dim=64, group_size=32)
    # n = 50 -> K: P = 32 packed, R = 18 residual; V is packed on arrival (all 50 tokens)
    assert parts["k_codes"] == 32 * 64 // 2
    assert parts["v_codes"] == 50 * 64
    assert parts["scales"] == (1 * 64 + 50 * 2) * 2 * 2
    assert parts["residual"] == 18 * 64 * 2  # K only, fp16 whatever the model dtype
    raw_v = layer_bytes_breakdown(LayerConfig(0.5, 4, 16), 100, kv_heads=1, head_dim=64, group_size=32)
    assert raw_v["v_codes"] == 32 * 64 * 2 and raw_v["residual"] == 2 * 18 * 64 * 2  # a 16-bit V is split like K
    assert parts["positions"] == 50 * 2  # int16: 100 slots


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


@given(config=st.sampled_from(CONFIGS), tokens=st.integers(1, 40000), batch=st.integers(1, 3),
       scorer=st.sampled_from([None, *(str(s) for s in ScorerName)]), calibrated=st.booleans(),
       floor=st.integers(0, 64), g=st.sampled_from([16, 32, 64]))
def test_plan_layer_parts_are_storage_plus_eviction_state(config, tokens, batch, scorer, calibrated, floor, g):
    """The parts are the storage breakdown plus the scorer state, each counted once, and sum to
    plan_layer_bytes; a layer that keeps every token holds no eviction state."""
    kw = dict(group_size=g, batch=batch, floor=floor, scorer=scorer, calibrated=calibrated)
    parts = plan_layer_parts(config, tokens, SMOL, **kw)
    assert tuple(parts) == PARTS and min(parts.values()) >= 0
    storage = layer_bytes_breakdown(config, tokens, kv_heads=3, head_dim=64, batch=batch, group_size=g,
                                    dtype="float32", floor=floor)
    assert {k: parts[k] for k in storage} == storage
    assert parts["scorer_state"] == scorer_state_bytes(config, tokens, scorer=scorer, num_heads=9, head_dim=64,
                                                       batch=batch, calibrated=calibrated)
    assert sum(parts.values()) == plan_layer_bytes(config, tokens, SMOL, **kw)
    if not config.evicts:
        assert parts["scorer_state"] == 0 and parts["positions"] == 0


@pytest.mark.parametrize("tokens", [None, 6, 40, 1000, 2048, 40000])
def test_plan_parts_sum_to_plan_bytes(tokens):
    layers = tuple(CONFIGS[(7 * i) % len(CONFIGS)] for i in range(30))
    plan = RoutingPlan(layers=layers, fingerprint=SMOL, budget_bytes=1, context_length=2048, scorer="snapkv",
                       sink_tokens=2, recent_tokens=8)
    for calibrated in (True, False):
        rows = plan_parts(plan, tokens, calibrated=calibrated)
        assert len(rows) == 30
        assert sum(sum(r.values()) for r in rows) == plan_bytes(plan, tokens, calibrated=calibrated)
        t = 2048 if tokens is None else tokens
        assert rows == [plan_layer_parts(c, t, SMOL, floor=10, scorer="snapkv", calibrated=calibrated)
                        for c in layers]
    assert plan_bytes(plan, tokens) == plan_bytes(plan, tokens, calibrated=True)
