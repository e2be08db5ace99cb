"""``model.compile(backend="moend")`` on a sliding-window hybrid (tiny Gemma 3: five sliding layers, one full):
the eager compressed tokens, one fused moend attention op per quantized layer of either kind, no graph break, and
the compiled cache holds what the eager one holds (its oldest tokens leave outside the graph, in ``settle``). The
inner compiler is ``aot_eager``: the passes and the kernels still run, without a cold inductor compile."""

from __future__ import annotations

import pytest
import torch
from moend_fx.passes.common import is_dequantize, is_sdpa
from torch._dynamo.utils import counters

from moend_fx.cache.generation import prepare, unprepare
from moend_fx.models import uncompile
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan
from tests.cache.sliding_models import WINDOW, sliding_model
from tests.compile.test_compile_generate import Recording, _generate, _packed_nodes

CONFIGS = (LayerConfig(1.0, 4, 8), LayerConfig(0.5, 8, 8), LayerConfig(1.0, 16, 16), LayerConfig(1.0, 16, 4),
           LayerConfig(1.0, 4, 4), LayerConfig(0.5, 4, 8))


@pytest.mark.parametrize("family", ["gemma3_text"])  # both kinds; Qwen2 sliding adds ~40 s of compile
def test_compiled_hybrid_matches_eager_and_fuses_both_kinds(family):
    model = sliding_model(family)
    fp = ModelFingerprint.from_model(model)
    plan = RoutingPlan(layers=CONFIGS[-fp.num_layers:], fingerprint=fp, budget_bytes=1, context_length=512)
    ids = torch.randint(0, 256, (1, 4 * WINDOW), generator=torch.Generator().manual_seed(0))
    prepare(model, plan, scorer="keynorm")
    try:
        want, want_cache = _generate(model, ids, 2 * WINDOW)
        torch._dynamo.reset()
        counters.clear()
        backend = Recording()
        model.compile(backend=backend, options={"inner": "aot_eager", "plan": plan}, fullgraph=True)
        got, got_cache = _generate(model, ids, 2 * WINDOW)
    finally:
        torch._dynamo.reset()
        uncompile(model)
        unprepare(model)
    assert torch.equal(got, want)
    assert sum(counters["graph_break"].values()) == 0
    quantized = [i for i, c in enumerate(plan.layers) if c.quantized]
    assert {i for i in quantized if fp.is_sliding(i)} and {i for i in quantized if not fp.is_sliding(i)}
    for gm in backend.graphs:
        assert sorted(n.meta["moend_layer"] for n in _packed_nodes(gm)) == quantized
        assert not any(is_dequantize(n) for n in gm.graph.nodes)
        assert all(not plan.layers[n.meta["moend_layer"]].quantized for n in gm.graph.nodes if is_sdpa(n))
    assert got_cache.held_tokens() == want_cache.held_tokens()
    assert got_cache.nbytes() == want_cache.nbytes() == got_cache.model_bytes()
