"""moend_fx.bench.capacity: the memory cap's parser and the largest batch, against hand calculations from the
memory model (full_cache_bytes, plan_bytes). No model runs here."""

from __future__ import annotations

import pytest

from moend_fx.bench.capacity import (
    BASIS,
    ModelShape,
    cache_bound,
    fit_rows,
    largest_batch,
    parse_memory_cap,
    workspace_parts,
)
from moend_fx.common.errors import MoendError
from moend_fx.plan.memory import full_cache_bytes, keep_count, plan_bytes
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan

# SmolLM2-135M's shapes (design.md): 30 layers, 9 heads, 3 KV heads, head_dim 64, fp32; vocab 49152, hidden 576,
# MLP 1536; weights ~538 MB.
SMOL = ModelFingerprint("LlamaForCausalLM", 30, 3, 64, 9, "float32")
SHAPE = ModelShape(SMOL, 49152, 576, 1536)
WEIGHTS = 538_060_000
CAP = 8 * 10**9


@pytest.mark.parametrize("text, value", [
    ("8GB", 8 * 10**9), ("8 GB", 8 * 10**9), ("8gb", 8 * 10**9), ("7.5GiB", int(7.5 * 2**30)),
    ("8000MB", 8 * 10**9), ("8e9", 8 * 10**9), ("123", 123), ("512 KiB", 512 * 1024),
])
def test_parse_memory_cap(text, value):
    assert parse_memory_cap(text) == value


@pytest.mark.parametrize("text", ["", "8 gigs", "14x", "-8GB", "0GB", "GB", None, 8])
def test_bad_memory_cap_names_the_allowed_forms(text):
    with pytest.raises(MoendError) as e:
        parse_memory_cap(text)
    msg = str(e.value)
    assert repr(text) in msg and "allowed" in msg and "8GB" in msg and "GiB" in msg


def test_workspace_by_hand():
    n = 4096
    ws = workspace_parts("full_eager", SHAPE, n)
    assert ws == {"logits": 49152 * 4, "activations": (4 * 576 + 3 * 1536) * 4, "scores": 9 * n * 4,
                  "kv_transient": 2 * 3 * n * 64 * 4}  # DynamicCache's torch.cat: one layer's K/V twice
    plan = RoutingPlan.uniform(LayerConfig(0.25, 4, 4), SMOL, n)
    held = keep_count(n, 0.25, plan.sink_tokens + plan.recent_tokens)
    assert held == 1024
    assert workspace_parts("moend_eager", SHAPE, n, plan)["kv_transient"] == 2 * 3 * held * 64 * 4
    fused = workspace_parts("moend_compiled", SHAPE, n, plan)
    assert fused["kv_transient"] == 0 and fused["scores"] == 9 * held * 4
    with pytest.raises(MoendError, match="allowed"):
        workspace_parts("fast", SHAPE, n)


def test_largest_batch_search():
    assert largest_batch(100, lambda b: 10 + 7 * b) == 12  # 10 + 84 <= 100 < 10 + 91
    assert largest_batch(16, lambda b: 10 + 7 * b) == 0
    assert largest_batch(17, lambda b: 10 + 7 * b) == 1
    assert largest_batch(10**6, lambda b: b) == 10**6


@pytest.mark.parametrize("n", [4096, 8192])
def test_full_cache_largest_batch_by_hand(n):
    # 4k: 30 layers x 2 (K, V) x 3 heads x 64 x 4 B = 188.7 MB a sequence
    per_seq = full_cache_bytes(SMOL, n, dtype=None)
    assert per_seq == 30 * 2 * 3 * n * 64 * 4
    ws = sum(workspace_parts("full_eager", SHAPE, n).values())
    row, = fit_rows({"full_eager": None}, (n,), SHAPE, WEIGHTS, CAP)
    assert row["largest_batch"] == (CAP - WEIGHTS) // (per_seq + ws)
    assert row["largest_batch"] == {4096: 38, 8192: 19}[n]
    assert row["cache_bytes_per_sequence"] == per_seq and row["basis"] == BASIS
    assert row["bytes_at_largest_batch"] == WEIGHTS + row["largest_batch"] * (per_seq + ws) <= CAP


@pytest.mark.parametrize("calibrated", [True, False])
def test_moend_largest_batch_by_hand(calibrated):
    n = 4096
    plan = RoutingPlan.uniform(LayerConfig(0.25, 4, 4), SMOL, n)
    one, two = plan_bytes(plan, n, 1, calibrated=calibrated), plan_bytes(plan, n, 2, calibrated=calibrated)
    per, fixed = two - one, 2 * one - two  # plan_bytes is affine in the batch (calibrated stats are shared)
    assert plan_bytes(plan, n, 7, calibrated=calibrated) == fixed + 7 * per
    ws = sum(workspace_parts("moend_compiled", SHAPE, n, plan).values())
    row, = fit_rows({"moend_compiled": {n: plan}}, (n,), SHAPE, WEIGHTS, CAP, calibrated=calibrated)
    assert row["largest_batch"] == (CAP - WEIGHTS - fixed) // (per + ws)
    assert row["cache_bytes_per_sequence"] == one
    full, = fit_rows({"full_eager": None}, (n,), SHAPE, WEIGHTS, CAP)
    assert row["largest_batch"] > 10 * full["largest_batch"]  # keep 0.25 + 4-bit: far more sequences fit


def test_cache_bound_caps_at_the_plans_length():
    plan = RoutingPlan.uniform(LayerConfig(0.5, 8, 8), SMOL, 2048)
    assert cache_bound(plan, SMOL, 1024, 3) == plan_bytes(plan, 1024, 3)
    assert cache_bound(plan, SMOL, 8192, 3) == plan_bytes(plan, 2048, 3)  # capacity mode holds the plan's bytes
    assert cache_bound(None, SMOL, 8192, 3) == full_cache_bytes(SMOL, 8192, 3, dtype=None)


def test_a_cap_below_the_weights_fits_nothing():
    row, = fit_rows({"full_eager": None}, (4096,), SHAPE, WEIGHTS, 10**8)
    assert row["largest_batch"] == 0 and row["bytes_at_largest_batch"] is None
