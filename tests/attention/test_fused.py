"""fused_layer_attention (the cache's default): the fused op for an eager decode step over a quantized layer,
packed_layer_attention everywhere else, and the pattern (never the op) when dynamo traces it."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moend_fx.kernels.ops as ops
from moend_fx.attention.fused import FUSED_MAX_QUERIES, fused_layer_attention
from moend_fx.attention.packed import packed_layer_attention
from moend_fx.attention.reference import reference_attention
from moend_fx.kernels.precision import FP32_RTOL, kernel_atol
from moend_fx.plan.routing import LayerConfig
from moend_fx.storage.packed import PackedKV


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _layer(kb, vb, b=1, hkv=2, n=70, d=16, g=16, seed=0):
    return PackedKV.from_dense(rand(b, hkv, n, d, seed=seed), rand(b, hkv, n, d, seed=seed + 1),
                               LayerConfig(1.0, kb, vb), g)


@pytest.fixture
def op_calls(monkeypatch):
    """The number of calls fused_layer_attention made to the fused op."""
    calls = []
    real = ops.packed_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "packed_attention", counting)
    return calls


@given(kb=st.sampled_from([2, 4, 8, 16]), vb=st.sampled_from([2, 4, 8]), group=st.sampled_from([1, 3]),
       n=st.integers(1, 90), l=st.integers(1, 3), seed=st.integers(0, 999))
def test_quantized_decode_runs_the_op_within_its_tolerance(kb, vb, group, n, l, seed):
    l = min(l, n)
    layer = _layer(kb, vb, n=n, seed=seed)
    q = rand(1, 2 * group, l, 16, seed=seed + 2)
    got = fused_layer_attention(q, layer)
    # The op rounds the query to int16 for the K dot: the kernel's stated bound against the fp32 reference.
    torch.testing.assert_close(got, reference_attention(q, layer), atol=kernel_atol(q, layer), rtol=FP32_RTOL)


def test_the_op_runs_for_a_few_queries_over_a_quantized_side(op_calls):
    q = rand(2, 4, 1, 16, seed=2)
    mask = torch.ones(2, 1, 1, 70, dtype=torch.bool)
    mask[0, ..., :9] = False  # left padding of row 0
    layer = _layer(4, 16, b=2)
    got = fused_layer_attention(q, layer, mask=mask)
    assert op_calls == [q.shape]
    torch.testing.assert_close(got, reference_attention(q, layer, mask=mask), atol=kernel_atol(q, layer),
                               rtol=FP32_RTOL)  # the op's int16 query rounding


@pytest.mark.parametrize("case", ["lossless", "prefill_chunk", "float_mask"])
def test_everything_else_is_the_pattern_bit_for_bit(case, op_calls):
    layer = _layer(16, 16) if case == "lossless" else _layer(4, 8)
    q = rand(1, 4, FUSED_MAX_QUERIES + 1 if case == "prefill_chunk" else 1, 16, seed=3)
    mask = torch.zeros(1, 1, q.shape[2], 70) if case == "float_mask" else None
    got = fused_layer_attention(q, layer, mask=mask)
    assert op_calls == []
    assert torch.equal(got, packed_layer_attention(q, layer, mask=mask))


def test_traced_it_is_the_pattern_the_backend_fuses():
    from torch._dynamo.testing import EagerAndRecordGraphs

    layer = _layer(4, 8)
    q = rand(1, 4, 1, 16, seed=4)
    backend = EagerAndRecordGraphs()
    got = torch.compile(lambda x: fused_layer_attention(x, layer), backend=backend, fullgraph=True)(q)
    (gm,) = backend.graphs
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert any("dequantize" in t for t in targets) and not any("packed_attention" in t for t in targets)
    torch.testing.assert_close(got, packed_layer_attention(q, layer), atol=2e-5, rtol=1e-4)  # SDPA order only
