"""How to property-test a kernel variant against the reference with hypothesis.

    python -m pytest examples/kernel_property_tests.py -q

(CI runs it with the tests: it is in pyproject's ``testpaths``.)

Every fast path in moend_fx is checked the same way: random K/V are compressed into a PackedKV exactly as the
cache stores them, and the fast op must agree with
`moend_fx.attention.reference.reference_attention` (dequantize the whole layer, plain softmax attention)
within a tolerance written next to the assert, with the reason.
"""

from __future__ import annotations

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from moend_fx.attention.reference import reference_attention
from moend_fx.common.defaults import GROUP_SIZE
from moend_fx.kernels import cpu, packed_attention, variant_name
from moend_fx.kernels.precision import FP32_RTOL, kernel_atol
from moend_fx.plan.routing import LayerConfig
from moend_fx.storage.packed import PackedKV


@settings(max_examples=20, deadline=None)
@given(
    k_bits=st.sampled_from([2, 4, 8, 16]),
    v_bits=st.sampled_from([2, 4, 8, 16]),
    head_dim=st.sampled_from([32, 64]),
    group=st.sampled_from([1, 3]),  # query heads per KV head (GQA ratio)
    groups=st.integers(0, 3),  # packed groups of GROUP_SIZE tokens
    residual=st.integers(0, GROUP_SIZE - 1),  # tokens still in the full-precision window
    seed=st.integers(0, 2**16),
)
def test_cpu_kernel_matches_reference(k_bits, v_bits, head_dim, group, groups, residual, seed):
    n = groups * GROUP_SIZE + residual
    assume(n > 0)
    # Without the built kernel "auto" falls back to the reference, and the test would compare it with itself.
    assert cpu.available(), cpu.build_error()
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 2, n, head_dim, generator=g)
    v = torch.randn(1, 2, n, head_dim, generator=g)
    q = torch.randn(1, 2 * group, 1, head_dim, generator=g)  # one decode query per head; never zeros
    layer = PackedKV.from_dense(k, v, LayerConfig(1.0, k_bits, v_bits), group_size=GROUP_SIZE)
    fast = packed_attention(q, layer, kernel="auto")
    ref = reference_attention(q, layer)
    # Same dequantized values both ways; the kernel dots the K codes with an int16-rounded q*s (a bound from the
    # inputs, see moend_fx/kernels/precision.py), the rest is fp32 summation order and the online softmax.
    torch.testing.assert_close(fast, ref, atol=kernel_atol(q, layer), rtol=FP32_RTOL,
                               msg=lambda m: f"{variant_name(k_bits, v_bits, head_dim, GROUP_SIZE)}: {m}")
