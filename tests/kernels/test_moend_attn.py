"""The fused C++ CPU kernel (moend_attn.cpp) against the eager reference, over every (K bits, V bits) pair,
head_dim 64 and 128, GQA groups 1/3/7, ragged packed/residual lengths; 1 thread against 2 threads.
Tolerances: moend_fx/kernels/precision.py (int16 query rounding on the K side, fp32 reordering elsewhere)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.attention.reference import reference_attention
from moend_fx.kernels import cpu, packed_attention
from moend_fx.kernels.precision import FP32_ATOL, FP32_RTOL, kernel_atol
from moend_fx.plan.routing import LayerConfig
from moend_fx.storage.packed import PackedKV

PAIRS = list(itertools.product([2, 4, 8, 16], repeat=2))
G = 32


def make_case(seed, b, hkv, gq, l, n, d, kb, vb):
    """Random non-zero K/V (per-channel offsets and spreads like real keys) compressed as the cache stores them."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hkv, n, d, generator=gen) * (1 + 3 * torch.rand(d, generator=gen)) + 0.5
    v = torch.randn(b, hkv, n, d, generator=gen) + 0.25
    layer = PackedKV.from_dense(k, v, LayerConfig(1.0, kb, vb), G)
    q = torch.randn(b, hkv * gq, l, d, generator=gen)
    return q, layer


@st.composite
def shapes(draw, max_groups=3):
    groups = draw(st.integers(0, max_groups))  # packed K/V groups of 32 tokens
    residual = draw(st.integers(0, G - 1))  # tokens in the fp16 window (ragged tail)
    l = draw(st.sampled_from([1, 1, 2]))  # mostly decode steps, sometimes a causal chunk
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
