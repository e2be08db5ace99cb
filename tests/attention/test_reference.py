import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from moend_fx.attention.reference import attention_dense, chunk_causal_mask, reference_attention
from moend_fx.common.errors import MoendError
from moend_fx.plan.routing import LayerConfig
from moend_fx.storage.packed import PackedKV


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@given(b=st.integers(1, 2), hkv=st.integers(1, 3), group=st.sampled_from([1, 3]), s=st.integers(1, 80),
       l=st.integers(1, 6), d=st.sampled_from([16, 64]), seed=st.integers(0, 999))
def test_dense_matches_sdpa_with_bottom_right_mask(b, hkv, group, s, l, d, seed):
    l = min(l, s)
    q = rand(b, hkv * group, l, d, seed=seed)
    k, v = rand(b, hkv, s, d, seed=seed + 1), rand(b, hkv, s, d, seed=seed + 2)
    mask = chunk_causal_mask(l, s)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    # fp32 both ways; only the summation order differs.
    torch.testing.assert_close(attention_dense(q, k, v), want, atol=1e-5, rtol=1e-4)


def test_chunk_mask_is_bottom_right():
    m = chunk_causal_mask(2, 5)
    assert m.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def test_reference_over_packed_layer_close_to_dense():
    k, v = rand(1, 3, 96, 64, seed=5), rand(1, 3, 96, 64, seed=6)
    q = rand(1, 9, 1, 64, seed=7)
    exact = attention_dense(q, k, v)
    lossless = reference_attention(q, PackedKV.from_dense(k, v, LayerConfig(1.0, 16, 16)))
    # a lossless layer is exactly attention over its fp16 copy of K/V (its storage type), read back as fp32
    assert torch.equal(lossless, attention_dense(q, k.half().float(), v.half().float()))
    torch.testing.assert_close(lossless, exact, atol=2e-3, rtol=0)  # fp16 rounding: 2^-11 relative per value
    q8 = reference_attention(q, PackedKV.from_dense(k, v, LayerConfig(1.0, 8, 8)))
    rel = (q8 - exact).norm() / exact.norm()
    assert 0 < rel < 0.02  # 8-bit K and V: well under 2% relative error on Gaussian data


def test_padding_mask_and_errors():
    q, k = rand(1, 2, 1, 16), rand(1, 1, 4, 16, seed=1)
    mask = torch.tensor([False, True, True, True]).view(1, 1, 1, 4)
    out = attention_dense(q, k, k, mask=mask)
    torch.testing.assert_close(out, attention_dense(q, k[:, :, 1:], k[:, :, 1:]))
    with pytest.raises(MoendError, match="multiple of KV heads"):
        attention_dense(rand(1, 3, 1, 16), rand(1, 2, 4, 16), rand(1, 2, 4, 16))
    with pytest.raises(MoendError, match="chunk of 5"):
        attention_dense(rand(1, 2, 5, 16), k, k)
