"""The build of the C++ kernel (moend_fx/kernels/cpu.py): OpenMP shared with torch, the portable loops, and the
AVX2 loops on a CPU whose default build takes the AVX-512 tier."""

from __future__ import annotations

import itertools

import pytest
import torch

from moend_fx.attention.reference import reference_attention
from moend_fx.kernels import cpu, layer_tensors, packed_attention
from moend_fx.kernels.precision import FP32_ATOL, FP32_RTOL, kernel_atol
from tests.kernels.masks import padding_mask
from tests.kernels.test_moend_attn import make_case

PORTABLE_NS = "moend_cpu_portable"
AVX2_NS = "moend_cpu_avx2"
AVX512_PAIRS_NS = "moend_cpu_avx512_pairs"


def test_built_with_torchs_openmp():
    assert cpu.available(), cpu.build_error()
    if not cpu.torch_uses_openmp():
        pytest.skip("torch's parallel backend is not OpenMP here")
    assert "-fopenmp" in cpu.compile_flags()
    # Without -fopenmp at::parallel_for compiles to a serial loop and the library needs no GOMP symbol.
    assert b"GOMP_parallel" in cpu.library_path().read_bytes()


def test_compile_flags():
    assert not set(cpu.AVX2_FLAGS) & set(cpu.compile_flags(avx2=False))
    assert set(cpu.AVX2_FLAGS) <= set(cpu.compile_flags(avx2=True))
    # the AVX-512 tier sits on top of AVX2, never alone
    assert not set(cpu.AVX512_FLAGS) & set(cpu.compile_flags(avx2=False, avx512=True))
    assert set(cpu.AVX2_FLAGS + cpu.AVX512_FLAGS) <= set(cpu.compile_flags(avx2=True, avx512=True))
    assert not set(cpu.AVX512_FLAGS) & set(cpu.compile_flags(avx2=True, avx512=False))
    assert cpu.VNNI_FLAG in cpu.compile_flags(avx2=True, avx512=True, vnni=True)
    assert cpu.VNNI_FLAG not in cpu.compile_flags(avx2=True, avx512=True, vnni=False)
    # VBMI (the integer V loop's byte permutes) comes with the VNNI tier only, where the CPU has it
    assert cpu.VBMI_FLAG not in cpu.compile_flags(avx2=True, avx512=True, vnni=False)
    assert (cpu.VBMI_FLAG in cpu.compile_flags(avx2=True, avx512=True, vnni=True)) == ("avx512vbmi" in cpu._cpu_flags())


@pytest.fixture(scope="module")
def portable():
    """The kernel built without -mavx2 (the loops a CPU without AVX2 runs), under its own op namespace."""
    try:
        cpu.build(cpu.compile_flags(avx2=False), namespace=PORTABLE_NS)
    except Exception as e:  # no compiler: the main kernel's tests already fail loudly
        pytest.skip(f"portable build failed: {e}")
    return getattr(torch.ops, PORTABLE_NS).packed_attention


@pytest.mark.parametrize("kb, vb", list(itertools.product([2, 4, 8, 16], repeat=2)))
def test_portable_loops_match_reference_and_avx2(portable, kb, vb):
    for seed, (d, gq, n, l) in enumerate([(64, 3, 3 * 32 + 7, 1), (128, 7, 2 * 32, 2), (64, 1, 19, 1)]):
        q, layer = make_case(seed, 1, 2, gq, l, n, d, kb, vb)
        args = (q, *(t.contiguous() for t in layer_tensors(layer)), kb, vb, 32, d ** -0.5, True, None, 0)
        out = portable(*args)
        # int16 query rounding + fp32 reordering (moend_fx/kernels/precision.py)
        torch.testing.assert_close(out, reference_attention(q, layer), atol=kernel_atol(q, layer), rtol=FP32_RTOL)
        # Both builds round q*s to the same int16 and sum the codes exactly: only float reordering differs.
        torch.testing.assert_close(out, packed_attention(q, layer, kernel="cpu"), atol=FP32_ATOL, rtol=FP32_RTOL)


@pytest.mark.parametrize("kb, vb", [(4, 8), (2, 2), (16, 4), (16, 16)])
def test_portable_loops_take_the_padding_mask(portable, kb, vb):
    for seed, (d, gq, n, l, kind) in enumerate([(64, 3, 3 * 32 + 7, 1, "left"), (128, 7, 2 * 32, 2, "per_head"),
                                                (64, 1, 5 * 32 + 3, 3, "random")]):
        q, layer = make_case(seed, 2, 2, gq, l, n, d, kb, vb)
        mask = padding_mask(seed, 2, 2 * gq, l, n, kind)
        args = (q, *(t.contiguous() for t in layer_tensors(layer)), kb, vb, 32, d ** -0.5, True, mask, 0)
        out = portable(*args)
        # int16 query rounding + fp32 reordering (moend_fx/kernels/precision.py)
        ref = reference_attention(q, layer, mask=mask)
        torch.testing.assert_close(out, ref, atol=kernel_atol(q, layer), rtol=FP32_RTOL)
        # the same int16 sums and the same masked blocks as the AVX2 build: float reordering only
        torch.testing.assert_close(out, packed_attention(q, layer, kernel="cpu", mask=mask), atol=FP32_ATOL,
                                   rtol=FP32_RTOL)


@pytest.fixture(scope="module")
def avx2_only():
    """The kernel built with AVX2 but not AVX-512, on a CPU whose default build takes the AVX-512 loops."""
    if not set(cpu.AVX512_FLAGS) <= set(cpu.compile_flags()):
        pytest.skip("this CPU's default build has no AVX-512 tier: the AVX2 loops are what every other test runs")
    cpu.build(cpu.compile_flags(avx512=False), namespace=AVX2_NS)
    return getattr(torch.ops, AVX2_NS).packed_attention


@pytest.fixture(scope="module")
def avx512_pairs():
    """The AVX-512 tier without VNNI (its K loop over token pairs), on a CPU whose default build takes the VNNI
    K loop."""
    if cpu.VNNI_FLAG not in cpu.compile_flags():
        pytest.skip("this CPU's default build has no VNNI K loop: the pair loop is what the other tests run")
    cpu.build(cpu.compile_flags(vnni=False), namespace=AVX512_PAIRS_NS)
    return getattr(torch.ops, AVX512_PAIRS_NS).packed_attention


# (head_dim, GQA group, tokens, queries, group size): ragged residual tails, 14 query rows (row blocks of 4, 4,
# 4, 2 in the VNNI K loop), a group size of 8 (K groups shorter than the VNNI loop's 16 tokens), and one of 64
# (2-bit V in the VNNI V loop: 16-byte V groups, 4 planes per chunk, rows two at a time).
TIER_CASES = [(64, 3, 3 * 32 + 7, 1, 32), (128, 7, 5 * 32 + 1, 2, 32), (64, 1, 19, 1, 32), (128, 3, 300, 1, 32),
              (64, 3, 12 * 8 + 5, 1, 8), (64, 3, 3 * 64 + 6, 1, 64)]


def check_tiers_agree(other, kb, vb):
    for seed, (d, gq, n, l, g) in enumerate(TIER_CASES):
        q, layer = make_case(seed, 2, 2, gq, l, n, d, kb, vb, g=g)
        args = (q, *(t.contiguous() for t in layer_tensors(layer)), kb, vb, g, d ** -0.5, True, None, 0)
        # Same int16 query values and exact integer sums on the K side; on the V side per-lane fp32 accumulation
        # in the same token order, or (the VNNI V loop) weights rounded to 23 bits per block, an fp32 rounding of
        # the block's largest weight: the tiers agree to fp32 reordering at most.
        torch.testing.assert_close(packed_attention(q, layer, kernel="cpu"), other(*args), atol=FP32_ATOL,
                                   rtol=FP32_RTOL)


@pytest.mark.parametrize("kb, vb", list(itertools.product([2, 4, 8, 16], repeat=2)))
def test_avx512_tier_matches_avx2_loops(avx2_only, kb, vb):
    check_tiers_agree(avx2_only, kb, vb)


@pytest.mark.parametrize("kb, vb", list(itertools.product([2, 4, 8, 16], repeat=2)))
def test_vnni_k_loop_matches_pair_loop(avx512_pairs, kb, vb):
    check_tiers_agree(avx512_pairs, kb, vb)
