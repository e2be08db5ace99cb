"""The family matrix: every family of ``moend_fx.models.tiny.TINY_CONFIGS`` (tiny random-weight models from
transformers' own config classes), run as a user would: the RoPE the scorers read is the model's own, the lossless
plan gives DynamicCache's greedy tokens, an 8x plan (calibrated, solved, prepared) keeps the cache's measured bytes
at or under its budget after the prompt and every decode step, and ``backend="moend"`` (aot_eager inner compiler:
the passes and kernels run, no inductor compile) gives the eager compressed tokens with every quantized layer fused
and no graph break. Adding a family is one row in TINY_CONFIGS."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import DynamicCache, LogitsProcessorList

from moend_fx import calibrate, get_solver
from moend_fx.cache.generation import prepare, unprepare
from moend_fx.eviction.rope import invert_rope, rope_from_model
from moend_fx.models import tiny_model, uncompile
from moend_fx.models.tiny import MHA_ONLY, TINY_CONFIGS
from moend_fx.plan.grid import Grid
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan
from tests.cache.budget_watch import BytesEveryStep, record_caches
from tests.compile.test_compile_generate import Recording as _Recording  # keeps every graph

PROMPT, NEW = 600, 16
# a small grid keeps calibration under a second a family; quantized sides only, so every layer of the plan is one
# the backend must fuse (with 16 bits in the grid, some families' random weights got plans of 16-bit layers only)
GRID = Grid((0.1, 0.25, 0.5, 1.0), (8, 4), (8, 4))


def _model(family: str):
    kv = 4 if family in MHA_ONLY else 2
    return tiny_model(family, num_layers=2, num_heads=4, num_kv_heads=kv, head_dim=32)


def _ids(t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (1, t), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids, n, **kw):
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)


@pytest.mark.parametrize("family", list(TINY_CONFIGS))
def test_the_scorers_rope_is_the_models_own(family):
    """Layer 0's keys depend on the token alone before RoPE (no family here adds positions elsewhere): the same 20
    tokens at positions 0-19 and 20-39, un-rotated with ``rope_from_model`` (partial rotary, interleaved pairs and
    GPT-NeoX's rotary module included), give the same pre-RoPE keys."""
    model = _model(family)
    ids = _ids(20).repeat(1, 2)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache)
    keys = cache.layers[0].keys.double()  # [1, Hkv, 40, D] post-RoPE
    pre = invert_rope(keys, torch.arange(40), rope_from_model(model))
    # float32 RoPE angles and projections: the two copies agree to ~1e-6 of the keys' size
    assert torch.allclose(pre[:, :, :20], pre[:, :, 20:], atol=1e-4 * keys.abs().max().item()), family
    assert not torch.allclose(keys[:, :, :20], keys[:, :, 20:], atol=1e-3 * keys.abs().max().item())


@pytest.mark.parametrize("family", list(TINY_CONFIGS))
def test_the_lossless_plan_gives_dynamic_cache_tokens(family):
    model = _model(family)
    ids = _ids(40)
    want = _greedy(model, ids, 12, cache=DynamicCache(config=model.config))
    plan = RoutingPlan.uniform(LayerConfig(1.0, 16, 16), ModelFingerprint.from_model(model), 64)
    try:
        prepare(model, plan)
        got = _greedy(model, ids, 12)
    finally:
        unprepare(model)
    assert torch.equal(got, want), family



def _fused_layers(graphs) -> set[int]:
    return {n.meta["moend_layer"] for gm in graphs for n in gm.graph.nodes
            if n.op == "call_function" and "packed_attention" in str(n.target)}


@pytest.mark.parametrize("family", list(TINY_CONFIGS))
def test_an_8x_plan_keeps_its_budget_eager_and_compiles_to_the_same_tokens(family, monkeypatch):
    model = _model(family)
    table = calibrate(model, token_ids=_ids(128, seed=1), grid=GRID)
    plan = get_solver("greedy").solve(table, "8x", context_length=PROMPT + NEW).plan
    assert any(c.evicts for c in plan.layers) and any(c.quantized for c in plan.layers)
    made = record_caches(monkeypatch)
    ids, watch = _ids(PROMPT, seed=2), BytesEveryStep(made)
    backend = _Recording()
    try:
        prepare(model, plan, table=table)
        want = _greedy(model, ids, NEW, logits_processor=LogitsProcessorList([watch]))
        torch._dynamo.reset()
        counters.clear()
        model.compile(backend=backend, options={"inner": "aot_eager", "plan": plan}, fullgraph=True)
        got = _greedy(model, ids, NEW)
    finally:
        torch._dynamo.reset()
        uncompile(model)
        unprepare(model)
    assert len(watch.seen) == NEW and max(watch.seen) <= plan.budget_bytes, (family, max(watch.seen))
    # the fused kernel differs from the eager path only in fp32 summation order: greedy tokens agree
    assert torch.equal(got, want), family
    assert sum(counters["graph_break"].values()) == 0
    assert _fused_layers(backend.graphs) == {i for i, c in enumerate(plan.layers) if c.quantized}, family
