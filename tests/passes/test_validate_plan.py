"""validate_plan: a plan that fits passes silently; each kind of misfit raises a PlanError naming it."""

import pytest
from moend_fx.passes.find_attention import find_attention
from moend_fx.passes.validate_plan import validate_plan

from moend_fx.common.errors import PlanError
from moend_fx.compile.settings import BackendSettings
from moend_fx.plan.routing import LayerConfig
from tests.passes.toy_graphs import CONFIGS, HIDDEN, ToyDecoder, capture, make_cache, make_plan, rand


@pytest.fixture(scope="module")
def graph():
    gm, _, _ = capture(ToyDecoder(3), rand(1, 1, HIDDEN), make_cache(CONFIGS["mixed"]))
    return find_attention(gm, None)


def check(gm, plan, **kw):
    before = str(gm.graph)
    out = validate_plan(gm, BackendSettings(plan=plan, inner="eager", **kw))
    assert str(out.graph) == before  # validation never edits the graph
    return out


def test_fitting_plan_passes(graph):
    check(graph, make_plan(CONFIGS["mixed"]))


def test_no_plan_does_not_fire(graph):
    check(graph, None)


def test_graph_without_attention_does_not_fire():
    gm, _, _ = capture(lambda x: x * 2, rand(3))
    check(find_attention(gm, None), make_plan(CONFIGS["mixed"]))


def test_wrong_bits_name_the_layer(graph):
    configs = list(CONFIGS["mixed"])
    configs[0] = LayerConfig(1.0, 8, 8)  # the cache holds K in 4 bits
    with pytest.raises(PlanError, match=r"layer 0: the graph reads K as 4-bit codes but the plan says k_bits=8"):
        check(graph, make_plan(configs))
    configs[0] = LayerConfig(1.0, 4, 4)
    with pytest.raises(PlanError, match=r"layer 0: the graph reads V as 8-bit.*v_bits=4"):
        check(graph, make_plan(configs))


def test_wrong_group_size(graph):
    with pytest.raises(PlanError, match="group size is 32 but the plan's group_size is 64"):
        check(graph, make_plan(CONFIGS["mixed"], group_size=64))


@pytest.mark.parametrize("field, bad, msg", [
    ("head_dim", 16, "head_dim is 8 in the graph but 16"),
    ("num_kv_heads", 1, "2 KV heads in the graph but num_kv_heads=1"),
    ("num_heads", 8, "4 query heads in the graph but num_heads=8"),
])
def test_wrong_model_shape(graph, field, bad, msg):
    with pytest.raises(PlanError, match=msg):
        check(graph, make_plan(CONFIGS["mixed"], **{field: bad}))


def test_plan_with_more_layers_than_the_graph(graph):
    configs = (*CONFIGS["mixed"], LayerConfig(1.0, 16, 16))
    with pytest.raises(PlanError, match=r"3 of the plan's 4 layers \(missing \[3\]\).*fullgraph=True"):
        check(graph, make_plan(configs))
    check(graph, make_plan(configs), require_all_layers=False)  # a graph break may split the decoder


def test_layer_beyond_the_plan(graph):
    with pytest.raises(PlanError, match="belongs to layer 2, but the plan has layers 0..1"):
        check(graph, make_plan(CONFIGS["mixed"][:2]))


def test_two_nodes_claiming_one_layer():
    def fn(q, layers):
        from moend_fx.attention.packed import packed_layer_attention

        return packed_layer_attention(q, layers[0]) + packed_layer_attention(q * 2, layers[0])

    gm, _, _ = capture(fn, rand(1, 4, 1, 8), make_cache(CONFIGS["two"]))
    with pytest.raises(PlanError, match="both belong to layer 0"):
        check(find_attention(gm, None), make_plan(CONFIGS["two"]))
