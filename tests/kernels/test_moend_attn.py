"""The fused C++ CPU kernel (moend_attn.cpp) against the eager reference, over every (K bits, V bits) pair,
head_dim 64 and 128, GQA groups 1/3/7, ragged packed/residual lengths, with and without a padding mask; 1 thread
against 2 threads. Tolerances: moend_fx/kernels/precision.py (int16 query rounding on the K side, fp32 reordering
elsewhere)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from moend_fx.attention.reference import reference_attention
from moend_fx.kernels import cpu, layer_tensors, packed_attention
from moend_fx.kernels.ops import reference_packed_attention
from moend_fx.kernels.precision import FP32_ATOL, FP32_RTOL, kernel_atol
from moend_fx.plan.routing import LayerConfig
from moend_fx.storage.packed import PackedKV
from tests.kernels.masks import mask_kinds, padding_mask, with_causal

PAIRS = list(itertools.product([2, 4, 8, 16], repeat=2))
G = 32


def make_case(seed, b, hkv, gq, l, n, d, kb, vb, g=G):
    """Random non-zero K/V (per-channel offsets and spreads like real keys) compressed as the cache stores them
    (group size g)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hkv, n, d, generator=gen) * (1 + 3 * torch.rand(d, generator=gen)) + 0.5
    v = torch.randn(b, hkv, n, d, generator=gen) + 0.25
    layer = PackedKV.from_dense(k, v, LayerConfig(1.0, kb, vb), g)
    q = torch.randn(b, hkv * gq, l, d, generator=gen)
    return q, layer


@st.composite
def shapes(draw, max_groups=3, ls=(1, 1, 2)):
    groups = draw(st.integers(0, max_groups))  # packed K/V groups of 32 tokens
    residual = draw(st.integers(0, G - 1))  # tokens in the fp16 window (ragged tail)
    l = draw(st.sampled_from(ls))  # mostly decode steps, sometimes a causal chunk
    n = max(groups * G + residual, l)
    return dict(seed=draw(st.integers(0, 2**16)), b=draw(st.sampled_from([1, 2])), hkv=draw(st.sampled_from([1, 2])),
                gq=draw(st.sampled_from([1, 3, 7])), l=l, n=n, d=draw(st.sampled_from([64, 128])))


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu.available(), cpu.build_error()  # else "cpu" would silently be the reference


@pytest.mark.parametrize("kb, vb", PAIRS)
@settings(max_examples=6)
@given(c=shapes())
def test_kernel_matches_reference(kb, vb, c):
    q, layer = make_case(kb=kb, vb=vb, **c)
    out = packed_attention(q, layer, kernel="cpu")
    ref = reference_attention(q, layer)
    # int16 rounding of q*s on the K side (3-sigma bound, see moend_fx/kernels/precision.py) + fp32 reordering.
    torch.testing.assert_close(out, ref, atol=kernel_atol(q, layer), rtol=FP32_RTOL)


@settings(max_examples=12)
@given(kb=st.sampled_from([2, 4, 8, 16]), vb=st.sampled_from([2, 4, 8, 16]), c=shapes(max_groups=24))
def test_two_threads_equal_one_thread(kb, vb, c):
    q, layer = make_case(kb=kb, vb=vb, **c)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = packed_attention(q, layer, kernel="cpu")
        torch.set_num_threads(2)
        two = packed_attention(q, layer, kernel="cpu")
    finally:
        torch.set_num_threads(before)
    # Same int16 query and integer K sums either way; only the token splits (and so the log-sum-exp merge
    # order) follow the thread count: fp32 reordering only.
    torch.testing.assert_close(two, one, atol=FP32_ATOL, rtol=FP32_RTOL)
    torch.testing.assert_close(two, reference_attention(q, layer), atol=kernel_atol(q, layer), rtol=FP32_RTOL)


@pytest.mark.parametrize("kb, vb", [(4, 4), (2, 8), (8, 2), (16, 4)])
def test_long_layer_many_splits(kb, vb):
    # SmolLM2's decode shape over ~3k tokens: several token splits per KV head, merged by log-sum-exp.
    q, layer = make_case(0, 1, 3, 3, 1, 3000 + 17, 64, kb, vb)
    ref = reference_attention(q, layer)
    for splits in (0, 1, 7):
        out = packed_attention(q, layer, kernel="cpu", num_splits=splits)
        torch.testing.assert_close(out, ref, atol=kernel_atol(q, layer), rtol=FP32_RTOL)  # as above


def test_residual_only_and_packed_only():
    for n in (5, 4 * G):  # all tokens in the window; none in it
        q, layer = make_case(1, 1, 2, 7, 1, n, 128, 4, 2)
        torch.testing.assert_close(packed_attention(q, layer, kernel="cpu"), reference_attention(q, layer),
                                   atol=kernel_atol(q, layer), rtol=FP32_RTOL)  # as above


@pytest.mark.parametrize("kb, vb", [(4, 8), (8, 4), (2, 2), (4, 16), (16, 8), (16, 16)])
@settings(max_examples=8)
@given(c=shapes(ls=(1, 1, 2, 5)), m=mask_kinds(), splits=st.sampled_from([0, 1, 3]))
def test_kernel_with_padding_mask_matches_reference(kb, vb, c, m, splits):
    """A padding mask (left padding, random holes, per-head holes) ANDed with the causal chunk: hidden tokens get
    weight 0 and a row that sees nothing gives 0, in the kernel as in the reference."""
    q, layer = make_case(kb=kb, vb=vb, **c)
    mask = padding_mask(m[1], c["b"], q.shape[1], c["l"], c["n"], m[0])
    out = packed_attention(q, layer, kernel="cpu", mask=mask, num_splits=splits)
    ref = reference_attention(q, layer, mask=mask)
    assert not out.isnan().any()
    # int16 rounding of q*s on the K side (3-sigma bound; the mask only drops tokens, so the bound over all held
    # tokens still holds) + fp32 reordering (moend_fx/kernels/precision.py).
    torch.testing.assert_close(out, ref, atol=kernel_atol(q, layer), rtol=FP32_RTOL)


@settings(max_examples=30)
@given(kb=st.sampled_from([2, 4, 8, 16]), vb=st.sampled_from([2, 4, 8, 16]), c=shapes(ls=(1, 2, 5)), m=mask_kinds())
def test_reference_mask_semantics_equal_sdpa(kb, vb, c, m):
    """The op's reference path with a mask is SDPA over the dequantized layer with attn_mask = mask AND the
    bottom-right causal mask (torch's SDPA also gives 0 for a row that may attend nothing)."""
    q, layer = make_case(kb=kb, vb=vb, **c)
    mask = padding_mask(m[1], c["b"], q.shape[1], c["l"], c["n"], m[0])
    out = reference_packed_attention(q, *layer_tensors(layer), kb, vb, G, 0.125, True, mask)
    k, v = layer.dequantize(torch.float32)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=with_causal(mask, True), scale=0.125, enable_gqa=True)
    # the same fp32 values, two fp32 attention implementations: summation order only
    torch.testing.assert_close(out, want, atol=FP32_ATOL, rtol=FP32_RTOL)


@pytest.mark.parametrize("kb, vb", [(4, 4), (2, 8), (16, 4)])
def test_long_left_padded_layer_many_splits(kb, vb):
    # ~3k tokens, row 0 left-padded by 1700 (13 whole blocks of 128 hidden from every query row: skipped), row 1 by
    # none, per-head holes on top; several token splits, some of them wholly hidden for row 0.
    q, layer = make_case(2, 2, 3, 3, 1, 3000 + 17, 64, kb, vb)
    mask = padding_mask(5, 2, 9, 1, 3017, "per_head")
    mask[0, :, :, :1700] = False
    mask[1] = True
    ref = reference_attention(q, layer, mask=mask)
    for splits in (0, 1, 7):
        out = packed_attention(q, layer, kernel="cpu", num_splits=splits, mask=mask)
        torch.testing.assert_close(out, ref, atol=kernel_atol(q, layer), rtol=FP32_RTOL)  # as above
