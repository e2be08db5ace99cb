"""Property-testing a kernel variant against the reference: the hypothesis strategies and the check that
moend_fx's own kernel tests use, importable by anyone writing a kernel (docs/kernel-testing.md).

    from hypothesis import given
    from moend_fx.testing import decode_cases, assert_matches_reference

    @given(decode_cases())
    def test_my_kernel(case):
        assert_matches_reference(my_kernel(case.q, case.layer), case)

A :class:`DecodeCase` is one decode step over one compressed layer, built exactly as the cache stores it:
random K/V (never zeros) compressed by :meth:`moend_fx.storage.packed.PackedKV.from_dense` into bit-packed groups
plus a full-precision residual window, and a random query. The reference is
:func:`moend_fx.attention.reference.reference_attention` (dequantize the whole layer, plain softmax attention).

Needs the ``dev`` extra (hypothesis); the library itself never imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from moend_fx.attention.reference import reference_attention
from moend_fx.common.defaults import GROUP_SIZE
from moend_fx.kernels.precision import FP32_RTOL, kernel_atol
from moend_fx.plan.routing import LayerConfig
from moend_fx.storage.packed import PackedKV

BITS = (2, 4, 8, 16)  # the K / V widths the storage packs (16: kept raw)


@dataclass(frozen=True)
class DecodeCase:
    """One decode step. q: [1, Hkv * gqa, 1, D] fp32; layer: the compressed K/V of n tokens, Hkv heads."""

    q: torch.Tensor
    layer: PackedKV
    k_bits: int
    v_bits: int
    tokens: int

    def reference(self) -> torch.Tensor:
        """[1, Hq, 1, D]: the eager reference attention over the dequantized layer."""
        return reference_attention(self.q, self.layer)


@st.composite
def decode_cases(draw: st.DrawFn, bits: tuple[int, ...] = BITS, head_dims: tuple[int, ...] = (32, 64),
                 gqa: tuple[int, ...] = (1, 3), kv_heads: tuple[int, ...] = (1, 2, 3),
                 max_groups: int = 3) -> DecodeCase:
    """Strategy of :class:`DecodeCase`: K and V bits from ``bits``, head dim, query heads per KV head (``gqa``),
    KV heads, 0..``max_groups`` packed groups of GROUP_SIZE tokens plus 0..GROUP_SIZE-1 residual tokens (at
    least one token), and a seed for the values."""
    k_bits, v_bits = draw(st.sampled_from(bits)), draw(st.sampled_from(bits))
    d, g, h = draw(st.sampled_from(head_dims)), draw(st.sampled_from(gqa)), draw(st.sampled_from(kv_heads))
    n = draw(st.integers(0, max_groups)) * GROUP_SIZE + draw(st.integers(0, GROUP_SIZE - 1))
    n = max(n, 1)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    k = torch.randn(1, h, n, d, generator=gen)
    v = torch.randn(1, h, n, d, generator=gen)
    q = torch.randn(1, h * g, 1, d, generator=gen)
    layer = PackedKV.from_dense(k, v, LayerConfig(1.0, k_bits, v_bits), group_size=GROUP_SIZE)
    return DecodeCase(q=q, layer=layer, k_bits=k_bits, v_bits=v_bits, tokens=n)


def assert_matches_reference(out: torch.Tensor, case: DecodeCase, atol: float | None = None) -> None:
    """Assert ``out`` ([1, Hq, 1, D]) equals the reference within ``atol`` (default: the bound moend_fx's CPU
    kernel is held to, :func:`moend_fx.kernels.precision.kernel_atol`: its K dot products round q*s to int16;
    the rest is fp32 summation order) and the fp32 relative tolerance."""
    tol = kernel_atol(case.q, case.layer) if atol is None else atol
    torch.testing.assert_close(out, case.reference(), atol=tol, rtol=FP32_RTOL,
                               msg=lambda m: f"k{case.k_bits}v{case.v_bits}, {case.tokens} tokens: {m}")
