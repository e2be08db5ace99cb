"""Gemma 3's attention shape through the fused CPU kernel: head_dim 256 and one KV head serving four query heads,
every K / V width, ragged packed / residual splits, decode and chunk queries, with and without a padding mask,
checked against the reference attention (tolerance: ``kernel_atol``, the int16 rounding of q * s on a quantized K
side plus fp32 reordering, moend_fx/kernels/precision.py)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.attention.reference import reference_attention
from moend_fx.kernels import packed_attention
from moend_fx.kernels.precision import FP32_RTOL, kernel_atol
from tests.kernels.test_ops import make_layer


@st.composite
def gemma_cases(draw):
    g = 32
    n = draw(st.sampled_from([0, g, 5 * g])) + draw(st.integers(0, g - 1))
    l = draw(st.sampled_from([1, 3]))
    return dict(kb=draw(st.sampled_from([2, 4, 8, 16])), vb=draw(st.sampled_from([2, 4, 8, 16])), n=max(n, l), l=l,
                b=draw(st.sampled_from([1, 2])), seed=draw(st.integers(0, 99)), masked=draw(st.booleans()))


@settings(max_examples=30, deadline=None)
@given(gemma_cases())
def test_head_dim_256_one_kv_head_matches_reference(c):
    layer = make_layer(c["seed"], c["b"], 1, c["n"], 256, c["kb"], c["vb"])
    gen = torch.Generator().manual_seed(c["seed"] + 1)
    q = torch.randn(c["b"], 4, c["l"], 256, generator=gen)
    mask = None
    if c["masked"]:  # a sliding layer's mask: the oldest held tokens hidden from every query of the step
        mask = torch.ones(c["b"], 1, c["l"], c["n"], dtype=torch.bool)
        mask[..., : c["n"] // 3] = False
        mask &= torch.ones(c["l"], c["n"], dtype=torch.bool).tril(c["n"] - c["l"])
    ref = reference_attention(q, layer, mask=mask)
    out = packed_attention(q, layer, kernel="cpu", mask=mask)
    assert out.shape == (c["b"], 4, c["l"], 256)
    torch.testing.assert_close(out, ref, atol=kernel_atol(q, layer), rtol=FP32_RTOL)
