"""packed_layer_attention (the traceable form the backend fuses) agrees with the reference attention."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moend_fx.attention.packed import packed_layer_attention
from moend_fx.attention.reference import chunk_causal_mask, reference_attention
from moend_fx.common.errors import MoendError
from moend_fx.plan.routing import LayerConfig
from moend_fx.storage.packed import PackedKV

BITS = st.sampled_from([2, 4, 8, 16])


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@given(kb=BITS, vb=BITS, hkv=st.integers(1, 2), group=st.sampled_from([1, 3]), n=st.integers(1, 80),
       l=st.integers(1, 5), d=st.sampled_from([8, 16]), g=st.sampled_from([8, 16]), seed=st.integers(0, 999))
def test_matches_reference_attention(kb, vb, hkv, group, n, l, d, g, seed):
    l = min(l, n)
    layer = PackedKV.from_dense(rand(1, hkv, n, d, seed=seed), rand(1, hkv, n, d, seed=seed + 1),
                                LayerConfig(1.0, kb, vb), g)
    q = rand(1, hkv * group, l, d, seed=seed + 2)
    got = packed_layer_attention(q, layer)
    want = reference_attention(q, layer)
    # Both read the same dequantized values (same op); only SDPA's vs the reference's fp32 summation order differ.
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_scale_and_padding_mask_match_reference():
    layer = PackedKV.from_dense(rand(2, 2, 50, 16), rand(2, 2, 50, 16, seed=1), LayerConfig(1.0, 4, 8), 16)
    q = rand(2, 4, 3, 16, seed=2)
    mask = torch.ones(2, 1, 3, 50, dtype=torch.bool)
    mask[0, :, :, :7] = False  # left padding of row 0
    got = packed_layer_attention(q, layer, scale=0.3, mask=mask)
    want = reference_attention(q, layer, scale=0.3, mask=mask)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)  # fp32 summation order only


def test_not_causal_attends_to_every_token():
    layer = PackedKV.from_dense(rand(1, 1, 40, 8), rand(1, 1, 40, 8, seed=1), LayerConfig(1.0, 8, 8), 32)
    q = rand(1, 2, 4, 8, seed=2)
    want = reference_attention(q, layer, causal_chunk=False)
    torch.testing.assert_close(packed_layer_attention(q, layer, causal=False), want, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(packed_layer_attention(q, layer), want, atol=1e-3)


def test_mask_is_bottom_right():
    assert chunk_causal_mask(2, 5).tolist() == [[True, True, True, True, False], [True] * 5]


@pytest.mark.parametrize("shape", [(1, 4, 8), (1, 3, 2, 8), (2, 4, 1, 8), (1, 4, 1, 16)])
def test_bad_query_shapes_raise(shape):
    layer = PackedKV.from_dense(rand(1, 2, 40, 8), rand(1, 2, 40, 8, seed=1), LayerConfig(1.0, 4, 4), 32)
    with pytest.raises(MoendError, match="q"):
        packed_layer_attention(rand(*shape), layer)
