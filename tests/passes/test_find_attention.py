"""find_attention: every attention node is tagged with its layer; nothing else is; the graph is unchanged."""

import pytest
import torch
from moend_fx.passes.common import META_KIND, META_LAYER, META_LAYER_SOURCE, layer_index_from_path
from moend_fx.passes.find_attention import find_attention

from moend_fx.attention.packed import packed_layer_attention
from tests.passes.toy_graphs import (
    CONFIGS,
    HIDDEN,
    KV_HEADS,
    EagerDecoder,
    ToyDecoder,
    capture,
    eager_attention,
    make_cache,
    rand,
)


def tagged(gm):
    return [(n.meta[META_LAYER], n.meta[META_KIND]) for n in gm.graph.nodes if META_LAYER in n.meta]


@pytest.mark.parametrize("tokens", [1, 3])  # decode (no mask) and a chunk (bottom-right mask)
def test_sdpa_nodes_get_layer_from_module_path(tokens):
    model = ToyDecoder(3)
    gm, _, _ = capture(model, rand(1, tokens, HIDDEN), make_cache(CONFIGS["mixed"]))
    before = str(gm.graph)
    find_attention(gm, None)
    assert tagged(gm) == [(0, "sdpa"), (1, "sdpa"), (2, "sdpa")]
    assert {n.meta[META_LAYER_SOURCE] for n in gm.graph.nodes if META_LAYER in n.meta} == {"module"}
    assert str(gm.graph) == before  # tags only


def test_sdpa_with_padding_mask_is_found():
    mask = torch.ones(1, 1, 2, 70, dtype=torch.bool)
    mask[..., :5] = False
    gm, _, _ = capture(ToyDecoder(2), rand(1, 2, HIDDEN), make_cache(CONFIGS["two"]), mask)
    find_attention(gm, None)
    assert tagged(gm) == [(0, "sdpa"), (1, "sdpa")]


def test_eager_matmul_softmax_matmul_is_found_and_other_softmax_is_not():
    kv = [(rand(1, KV_HEADS, 20, 8, seed=i), rand(1, KV_HEADS, 20, 8, seed=i + 9)) for i in range(3)]
    gm, _, _ = capture(EagerDecoder(3), rand(1, 4, HIDDEN), kv)
    find_attention(gm, None)
    assert tagged(gm) == [(0, "eager"), (1, "eager"), (2, "eager")]
    softmaxes = [n for n in gm.graph.nodes if "softmax" in str(n.target)]
    assert len(softmaxes) == 4  # 3 in attention + the head's softmax over dim 1, which is not attention
    for n in tagged_nodes(gm):
        assert n.op == "call_function" and "matmul" in str(n.target)


def tagged_nodes(gm):
    return [n for n in gm.graph.nodes if META_LAYER in n.meta]


def test_layer_from_input_names_without_modules():
    def fn(q, layers):
        return [packed_layer_attention(q, layers[i]) for i in (1, 0)]

    cache = make_cache(CONFIGS["two"])
    gm, _, _ = capture(fn, rand(1, 4, 1, 8), cache)
    find_attention(gm, None)
    assert tagged(gm) == [(1, "sdpa"), (0, "sdpa")]
    assert {n.meta[META_LAYER_SOURCE] for n in tagged_nodes(gm)} == {"inputs"}


def test_order_fallback_when_nothing_names_the_layer():
    def fn(q, k, v):
        return eager_attention(q, k, v) + torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    gm, _, _ = capture(fn, rand(1, 4, 2, 8), rand(1, 2, 5, 8, seed=1), rand(1, 2, 5, 8, seed=2))
    find_attention(gm, None)
    assert sorted(tagged(gm)) == [(0, "eager"), (1, "sdpa")]
    assert {n.meta[META_LAYER_SOURCE] for n in tagged_nodes(gm)} == {"order"}


def test_graph_without_attention_is_untouched():
    gm, _, _ = capture(lambda x: torch.softmax(x @ x.T, dim=0) @ x, rand(4, 4))
    find_attention(gm, None)
    assert tagged(gm) == []


@pytest.mark.parametrize("path, want", [
    ("L['self'].model.layers.7.self_attn", 7),
    ("L['self'].model.layers[12].self_attn", 12),
    ("model.layers.3", 3),
    ("L__self___model_layers_5_self_attn", 5),
    ("L_cache_layers_2_k_res", 2),
    ("transformer.h.11.attn", 11),
    ("encoder.0.blocks.4.attn", 4),
    ("L['s'].stack.9.attn", 9),
    ("L['self'].model.norm", None),
])
def test_layer_index_from_path(path, want):
    assert layer_index_from_path(path) == want
