"""End to end on a tiny HF model: prepare -> model.compile(backend="moend", fullgraph=True) -> generate gives the
eager MoENDCache tokens, with the quantized layers' attention fused, no graph break and one decode graph."""

import pytest
import torch
from moend_fx.passes import run_passes
from moend_fx.passes.common import is_dequantize, is_sdpa
from torch._dynamo.utils import counters

from moend_fx.cache.generation import prepare, unprepare
from moend_fx.compile.backend import compile_inner
from moend_fx.compile.settings import BackendSettings
from moend_fx.models import tiny_model, uncompile
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan

PACKED_OP = "moend::packed_attention"


class Recording:
    """A ``moend`` backend that keeps every graph after the passes (one per compile)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs, options=None, **kw):
        settings = BackendSettings.from_options(options, **kw)
        gm = run_passes(gm, settings)
        self.graphs.append(gm)
        return compile_inner(gm, example_inputs, settings)


def _model():
    return tiny_model("llama", num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16)


def _plan(model, configs):
    return RoutingPlan(layers=tuple(configs), fingerprint=ModelFingerprint.from_model(model), budget_bytes=1,
                       context_length=128)


def _generate(model, ids, n):
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, return_dict_in_generate=True)
    return out.sequences, out.cache


def _eager_then_compiled(model, plan, ids, n, inner="aot_eager", **prepare_kw):
    prepare(model, plan, **prepare_kw)
    want, want_cache = _generate(model, ids, n)
    torch._dynamo.reset()
    counters.clear()
    backend = Recording()
    try:
        model.compile(backend=backend, options={"inner": inner, "plan": plan}, fullgraph=True)
        got, got_cache = _generate(model, ids, n)
    finally:
        torch._dynamo.reset()
        uncompile(model)
        unprepare(model)
    return want, want_cache, got, got_cache, backend.graphs


def _packed_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("moend.packed_attention")
            or PACKED_OP in str(getattr(n.target, "_name", ""))]


def test_compiled_generate_matches_eager_and_fuses_every_quantized_layer():
    model = _model()
    plan = _plan(model, (LayerConfig(1.0, 4, 8), LayerConfig(1.0, 16, 16), LayerConfig(1.0, 8, 2)))
    # 60-token prompt: layer residuals hold 28 tokens, so the 4th new token fills a group (flushed before step 5).
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(0))
    want, want_cache, got, got_cache, graphs = _eager_then_compiled(model, plan, ids, 8)
    # Greedy tokens agree exactly: the fused kernel differs from SDPA only in fp32 summation order.
    assert torch.equal(got, want)
    assert sum(counters["graph_break"].values()) == 0
    assert len(graphs) == 1  # the prefill runs eagerly; one graph serves every decode step
    gm = graphs[0]
    fused = {n.meta["moend_layer"]: n for n in _packed_nodes(gm)}
    assert sorted(fused) == [0, 2]  # one moend attention op per quantized layer
    assert fused[0].name == "attn_k4_v8_hd16_g32_layer0" and fused[2].name == "attn_k8_v2_hd16_g32_layer2"
    sdpa = [n for n in gm.graph.nodes if is_sdpa(n)]
    assert [n.meta["moend_layer"] for n in sdpa] == [1]  # the 16/16 layer keeps plain SDPA
    assert not any(is_dequantize(n) for n in gm.graph.nodes)  # nothing dequantizes a layer any more
    assert got_cache.nbytes() == want_cache.nbytes() == got_cache.model_bytes()


def test_200_decode_steps_with_eviction_run_one_graph_and_match_eager():
    """Evicting + quantized + lossless layers, re-eviction every 16 steps, 200 greedy steps: the eviction runs
    outside the graph (before_step), so fullgraph holds and a single decode graph serves every step."""
    model = _model()
    plan = _plan(model, (LayerConfig(0.5, 4, 8), LayerConfig(1.0, 16, 16), LayerConfig(1.0, 8, 2)))
    # 80-token prompt: every quantized layer holds a packed group at the first decode step (40 and 80 tokens).
    # (A layer with no packed group yet costs one more graph when its first group appears: docs/compile.md.)
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(1))
    want, want_cache, got, got_cache, graphs = _eager_then_compiled(
        model, plan, ids, 200, scorer="keynorm", evict_every=16, budget_mode="ratio")
    assert torch.equal(got, want)
    assert sum(counters["graph_break"].values()) == 0
    assert len(graphs) == 1, f"{len(graphs)} compiled graphs over 200 decode steps"
    # layer 0 (K4) re-evicts whole packed groups, once a whole group is over its ratio: about every 64 steps
    assert got_cache.layers[0].evictions == want_cache.layers[0].evictions >= 3
    assert got_cache.held_tokens() == want_cache.held_tokens()
    assert got_cache.nbytes() == want_cache.nbytes() == got_cache.model_bytes()


def test_a_second_batch_size_compiles_once_across_flushes_and_evictions():
    """After a batch of 1, a batch of 2 decodes 64 steps (each quantized layer flushes, layer 0 re-evicts) on one
    more graph. The batch size change makes dynamo's batch axis symbolic, and then it guards a view on its base:
    the prompt's packed scales used to be views (a squeeze) where a flush's are fresh tensors, so each layer's
    first flush recompiled (``'NoneType' object has no attribute 'size'`` in the guard, the batch rows of
    `moend bench decode`)."""
    model = _model()
    plan = _plan(model, (LayerConfig(0.5, 4, 8), LayerConfig(1.0, 16, 16), LayerConfig(1.0, 8, 2)))
    one = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(3))
    two = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(4))
    prepare(model, plan, scorer="keynorm", evict_every=16, budget_mode="ratio")
    want, want_cache = _generate(model, two, 64)
    torch._dynamo.reset()
    backend = Recording()
    try:
        model.compile(backend=backend, options={"inner": "aot_eager", "plan": plan}, fullgraph=True)
        _generate(model, one, 4)
        first = len(backend.graphs)
        got, got_cache = _generate(model, two, 64)
    finally:
        torch._dynamo.reset()
        uncompile(model)
        unprepare(model)
    assert torch.equal(got, want)
    assert got_cache.layers[0].evictions == want_cache.layers[0].evictions >= 1
    assert len(backend.graphs) - first == 1, f"{len(backend.graphs) - first} graphs for the batch of 2"


@pytest.mark.parametrize("scorer", ["snapkv", "trig"])
def test_scorers_with_a_query_window_match_eager(scorer):
    """Scorers that keep the last queries (snapkv; trig without calibrated stats) update their window inside the
    compiled step; tokens still equal eager. Not fullgraph-count critical: the window grows until it is full."""
    model = _model()
    # layer 0 has 16-bit K, so it re-evicts token by token every 8 steps, scoring with the window
    plan = _plan(model, (LayerConfig(0.25, 16, 4), LayerConfig(0.5, 16, 16), LayerConfig(1.0, 4, 4)))
    ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(2))
    want, want_cache, got, got_cache, graphs = _eager_then_compiled(model, plan, ids, 24, scorer=scorer,
                                                                     evict_every=8, budget_mode="ratio")
    assert torch.equal(got, want)
    assert sum(counters["graph_break"].values()) == 0
    assert got_cache.layers[0].evictions == want_cache.layers[0].evictions >= 3
    assert len(graphs) <= 3


def test_capacity_mode_compiled_equals_eager_and_keeps_graphs_bounded():
    """Capacity mode (the default) evicts on the byte cap from before_step, outside the graph, and its keep-1.0
    layers start evicting past the plan's 128 tokens (their storage gains positions): each such change of what a
    layer stores is one more graph, after which the steps reuse them. Tokens and bytes equal eager."""
    model = _model()
    plan = _plan(model, (LayerConfig(0.5, 4, 8), LayerConfig(1.0, 16, 16), LayerConfig(1.0, 8, 2)))
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(1))
    want, want_cache, got, got_cache, graphs = _eager_then_compiled(model, plan, ids, 200, scorer="keynorm")
    assert torch.equal(got, want)
    assert sum(counters["graph_break"].values()) == 0
    assert got_cache.held_tokens() == want_cache.held_tokens()
    assert got_cache.nbytes() == want_cache.nbytes() == got_cache.model_bytes()
    assert got_cache.nbytes().total <= got_cache.budget_bytes().total
    assert all(layer.evictor.evicting for layer in got_cache.layers)
    assert len(graphs) <= 8, f"{len(graphs)} compiled graphs over 200 decode steps"


@pytest.mark.parametrize("num_beams", [1, 2])
def test_left_padded_batch_and_beam_search_match_eager(num_beams):
    """Padding gives attention a real mask, which the fused op takes (the quantized layers stay fused); the deferred
    eviction keeps the step's mask, and a beam reorder settles it before the rows move. Tokens equal eager."""
    model = _model()
    plan = _plan(model, (LayerConfig(0.5, 4, 8), LayerConfig(1.0, 16, 16), LayerConfig(0.25, 8, 4)))
    g = torch.Generator().manual_seed(3)
    ids = torch.zeros(2, 70, dtype=torch.long)
    mask = torch.zeros(2, 70, dtype=torch.long)
    ids[0], mask[0] = torch.randint(3, 256, (70,), generator=g), 1
    ids[1, 20:], mask[1, 20:] = torch.randint(3, 256, (50,), generator=g), 1
    gen = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0, attention_mask=mask,
               num_beams=num_beams)
    prepare(model, plan, scorer="keynorm", evict_every=8)
    want = model.generate(ids, **gen)
    torch._dynamo.reset()
    counters.clear()
    backend = Recording()
    try:
        model.compile(backend=backend, options={"inner": "aot_eager", "plan": plan}, fullgraph=True)
        got = model.generate(ids, **gen)
    finally:
        torch._dynamo.reset()
        uncompile(model)
        unprepare(model)
    # Greedy / beam tokens agree exactly here (the fused kernel differs from SDPA by the int16 K rounding and fp32
    # summation order only, far below this tiny model's logit margins).
    assert torch.equal(got, want)
    assert sum(counters["graph_break"].values()) == 0
    assert graphs_fused_with_mask(backend.graphs) == [0, 2]


def graphs_fused_with_mask(graphs):
    """The layers whose attention is a fused op reading a padding mask, in every graph (sorted, each once)."""
    layers = set()
    for gm in graphs:
        for n in _packed_nodes(gm):
            assert n.args[-1] is not None, f"{n.name} fused without the batch's padding mask"
            layers.add(n.meta["moend_layer"])
        assert [n.meta["moend_layer"] for n in gm.graph.nodes if is_sdpa(n)] == [1]  # only the 16/16 layer
    return sorted(layers)


def test_a_window_that_fills_during_decode_does_not_recompile():
    """Capacity mode with a scorer that reads a window of queries at decode: the keep-1.0 layers start evicting
    past the plan's 128 tokens with an empty window that then grows by one query a step. The graph pushes
    nothing (finish_deferred does, outside it), so the window's length never guards it: as many graphs as with
    a scorer that keeps no window (test above). Tokens and bytes equal eager."""
    model = _model()
    plan = _plan(model, (LayerConfig(0.5, 4, 8), LayerConfig(1.0, 16, 16), LayerConfig(1.0, 8, 2)))
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(1))
    want, want_cache, got, got_cache, graphs = _eager_then_compiled(model, plan, ids, 120, scorer="snapkv")
    assert torch.equal(got, want)
    assert got_cache.nbytes() == want_cache.nbytes() == got_cache.model_bytes()
    assert all(layer.evictor.evicting for layer in got_cache.layers)
    windows = [layer.evictor.window.queries.shape[2] for layer in got_cache.layers]
    assert windows == [layer.evictor.window.size for layer in got_cache.layers]  # they filled while compiled
    assert len(graphs) <= 4, f"{len(graphs)} compiled graphs over 120 decode steps"  # 7 when the graph pushed
