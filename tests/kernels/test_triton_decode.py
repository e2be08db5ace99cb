"""The Triton decode kernel against the reference, under the Triton interpreter on CPU (tiny shapes).

TRITON_INTERPRET=1 must be set before Triton itself is imported (its own ``@triton.jit`` helpers, e.g. the
reduction combiners, are decorated then), and other test modules in the same process import Triton through
torch first. So on a machine without CUDA the tests run in a child pytest process started with the variable
set; the parent's single test reports the child's result.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.attention.reference import reference_attention
from moend_fx.kernels import layer_tensors, packed_attention, triton_decode
from moend_fx.plan.routing import LayerConfig
from moend_fx.storage.packed import PackedKV
from tests.kernels.masks import mask_kinds, padding_mask

CHILD = os.environ.get("MOEND_TRITON_CHILD") == "1"
RUN_HERE = CHILD or torch.cuda.is_available()
# On a CUDA machine the cases run compiled on the GPU (the reference too), under the interpreter on the CPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

if not RUN_HERE:

    def test_triton_kernel_suite_under_interpreter():
        env = {**os.environ, "TRITON_INTERPRET": "1", "MOEND_TRITON_CHILD": "1"}
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", __file__, "-x", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
             "-p", "no:randomly"], env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
        assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


in_child_only = pytest.mark.skipif(not RUN_HERE, reason="runs in the child process (see the module docstring)")


def make_case(seed, b, hkv, ratio, n, d, l, kb, vb, g=32):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hkv, n, d, generator=gen) * (1 + 3 * torch.rand(d, generator=gen)) + 0.5
    v = torch.randn(b, hkv, n, d, generator=gen)
    q = torch.randn(b, hkv * ratio, l, d, generator=gen)
    return q.to(DEVICE), PackedKV.from_dense(k, v, LayerConfig(1.0, kb, vb), g).map(lambda t: t.to(DEVICE))


def fp32_kernel(q, layer, kb, vb, **kw):
    """The kernel with fp32 dots (precise=True), at the default scale 1/sqrt(D): what the reference computes."""
    return triton_decode.packed_attention_triton(q, *layer_tensors(layer), kb, vb, 32, q.shape[-1] ** -0.5, True,
                                                 precise=True, **kw)


@st.composite
def cases(draw, dims=(16, 32, 64, 128)):
    g = 32
    # P: none, whole K groups short of a 128-token block, and one block plus tail groups (the main loop's edge)
    p = draw(st.sampled_from([0, g, 2 * g, 128 + g]))
    r = draw(st.integers(0, g - 1))
    l = draw(st.sampled_from([1, 3]))
    return dict(kb=draw(st.sampled_from([2, 4, 8, 16])), vb=draw(st.sampled_from([2, 4, 8, 16])),
                d=draw(st.sampled_from(dims)), n=max(p + r, l), l=l, hkv=draw(st.sampled_from([1, 2])),
                ratio=draw(st.sampled_from([1, 3, 7])), b=draw(st.sampled_from([1, 2])),
                splits=draw(st.sampled_from([0, 2, 3])), seed=draw(st.integers(0, 99)))


@in_child_only
@settings(max_examples=14, deadline=None)
@given(cases())
def test_triton_interpret_matches_reference(c):
    q, layer = make_case(c["seed"], c["b"], c["hkv"], c["ratio"], c["n"], c["d"], c["l"], c["kb"], c["vb"])
    out = fp32_kernel(q, layer, c["kb"], c["vb"], num_splits=c["splits"])
    # fp32 everywhere with identical dequantized values; blockwise online softmax and the split merge only
    # reorder the sums.
    torch.testing.assert_close(out, reference_attention(q, layer), atol=1e-5, rtol=1e-4)


@in_child_only
@settings(max_examples=8, deadline=None)
@given(cases(), mask_kinds())
def test_triton_interpret_with_padding_mask_matches_reference(c, m):
    """The kernel loads the padding mask [B, 1 or H, L, S] per block (ANDed with the causal limit): hidden tokens
    get weight 0, a row that sees nothing gives 0."""
    q, layer = make_case(c["seed"], c["b"], c["hkv"], c["ratio"], c["n"], c["d"], c["l"], c["kb"], c["vb"])
    mask = padding_mask(m[1], c["b"], q.shape[1], c["l"], c["n"], m[0]).to(DEVICE)
    out = fp32_kernel(q, layer, c["kb"], c["vb"], num_splits=c["splits"], mask=mask)
    # as above: identical dequantized values in fp32, only the summation order differs
    torch.testing.assert_close(out, reference_attention(q, layer, mask=mask), atol=1e-5, rtol=1e-4)


@in_child_only
def test_triton_mask_over_splits_and_query_blocks():
    # 24 rows in 2 query blocks, 4 token splits of one 128-token block (the first wholly hidden for batch row 0),
    # residual 5, a per-head mask read through a strided slice (the cache's mask[..., :n]) and one row that sees
    # nothing.
    q, layer = make_case(8, 2, 1, 6, 4 * 128 + 5, 16, 4, 4, 8)
    logical = padding_mask(3, 2, 6, 4, 4 * 128 + 20, "per_head").to(DEVICE)
    logical[0, :, :, :140] = False
    logical[1, 3, 2] = False
    mask = logical[..., : 4 * 128 + 5]
    out = triton_decode.packed_attention_triton(
        q, *layer_tensors(layer), 4, 8, 32, 0.25, True, mask, num_splits=4, block_m=16, precise=True)
    ref = reference_attention(q, layer, scale=0.25, mask=mask.contiguous())
    assert not out.isnan().any() and out[1, 3, 2].abs().max() == 0
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)  # fp32 reordering


@in_child_only
def test_triton_long_split_and_query_blocks():
    # 6 query heads x 4 queries = 24 rows over 2 query blocks of 16; 4 token splits of one block; residual 5.
    q, layer = make_case(7, 1, 1, 6, 4 * 128 + 5, 16, 4, 4, 8)
    out = triton_decode.packed_attention_triton(
        q, *layer_tensors(layer), 4, 8, 32, 0.25, True, num_splits=4, block_m=16, precise=True)
    ref = reference_attention(q, layer, scale=0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)  # fp32 reordering


@in_child_only
def test_choose_splits_fills_one_wave():
    cpu = torch.device("cpu")
    assert triton_decode.choose_splits(64, 3, 32, cpu) == 1  # too short for 4 blocks a split
    assert triton_decode.choose_splits(8192, 1, 32, cpu) == 4  # 4 slots on a CPU
    assert triton_decode.choose_splits(8192, 3, 32, cpu) == 1  # 3 programs already fill most of them


def fp16_tolerance(q, layer, scale):
    """Bound on the fp16-operand path's error (against the fp32 reference over the same dequantized K/V).

    fp16 rounds q (times scale), each dequantized k and v and each probability p to 2^-11 relative (the 1024 + code
    unpack and the exact subtraction add nothing; accumulation is fp32). A logit moves by ~2^-11 ||q * k_t|| per
    rounded factor (random signs: an l2 sum), so by 3 sigma for 2 factors 6 * 2^-11 * max_t ||q * k_t|| * scale;
    the output, a p-weighted mean of v, moves by that times max |v| plus 3 * 2^-11 * max |v| from p and v."""
    k, v = (t.float() for t in layer.dequantize())
    gq = q.shape[1] // k.shape[1]
    qk = (q.float().unsqueeze(3) * k.repeat_interleave(gq, 1).unsqueeze(2)).norm(dim=-1)  # [B, H, L, S]
    eps = 2.0 ** -11
    return 1e-5 + eps * (6 * qk.max().item() * scale + 3) * v.abs().max().item()


@in_child_only
@settings(max_examples=12, deadline=None)
@given(cases(dims=(16, 64, 128, 256)))
def test_triton_fp16_operands_stay_near_the_reference(c):
    """The op's path (packed_attention, kernel="triton"): fp16 dot operands, fp32 accumulation; widths 2-16, head_dim
    up to 256, GQA 1/3/7, ragged residuals, tail groups past the last 128-token block, split edges."""
    q, layer = make_case(c["seed"], c["b"], c["hkv"], c["ratio"], c["n"], c["d"], c["l"], c["kb"], c["vb"])
    out = packed_attention(q, layer, kernel="triton", num_splits=c["splits"])
    ref = reference_attention(q, layer)
    tol = fp16_tolerance(q, layer, c["d"] ** -0.5)
    assert (out - ref).abs().max().item() <= tol, ((out - ref).abs().max().item(), tol)  # bound: fp16_tolerance
    assert (out - ref).abs().max().item() > 0 or c["kb"] == c["vb"] == 16  # fp16 operands really were used


@in_child_only
@pytest.mark.parametrize("masked", [False, True])
def test_triton_long_layer_blocks_and_in_launch_merge(masked):
    # P = 640 packed tokens: 5 blocks of 128 in 3 splits of 2 blocks (the last short), residual 7, 6 query heads x 2
    # queries over one KV head; the splits merged inside the launch, the tickets left at 0 for the next call
    q, layer = make_case(11, 2, 1, 6, 640 + 7, 16, 2, 4, 2)
    assert triton_decode._launch_shape(640, 2, 12, 32, None, 3, q.device) == (128, 16, 1, 3, 256)
    mask = padding_mask(5, 2, 6, 2, 647, "per_head").to(DEVICE) if masked else None
    out = fp32_kernel(q, layer, 4, 2, num_splits=3, mask=mask)
    torch.testing.assert_close(out, reference_attention(q, layer, mask=mask), atol=1e-5, rtol=1e-4)  # fp32 order
    assert triton_decode._tickets(1, q.device).abs().sum().item() == 0


@in_child_only
def test_triton_packed_tail_past_the_last_block():
    # P = 3 * 128 + 2 * 32: two splits of whole blocks, the last split also walks the two tail groups, then R = 9
    q, layer = make_case(4, 1, 2, 3, 3 * 128 + 64 + 9, 64, 1, 8, 4)
    assert triton_decode._launch_shape(448, 2, 3, 32, None, 2, q.device) == (128, 16, 1, 2, 256)
    out = fp32_kernel(q, layer, 8, 4, num_splits=2)
    torch.testing.assert_close(out, reference_attention(q, layer), atol=1e-5, rtol=1e-4)  # fp32 reordering


def _run_ptx(asm: str, word: int) -> list[int]:
    """Emulate the unpack PTX (prmt, lop3 a & b, mov.b32 {lo, hi}) on one 32-bit word: the 16-bit outputs."""
    regs, outs = {}, {}
    n_out = asm.count("mov.b32") * 2

    def val(tok):
        tok = tok.strip()
        if tok == f"${n_out}":
            return word
        return regs[tok] if tok in regs else int(tok, 0)

    for line in asm.splitlines():
        op, _, args = line.rstrip(";").partition(" ")
        a = [x.strip() for x in args.split(",")] if "{" not in args else None
        if op == "prmt.b32":
            src = val(a[1]).to_bytes(4, "little") + val(a[2]).to_bytes(4, "little")
            sel = val(a[3])
            regs[a[0]] = int.from_bytes(bytes(src[(sel >> 4 * k) & 7] for k in range(4)), "little")
        elif op == "lop3.b32":
            assert a[4] == "0xc0"  # a & b
            regs[a[0]] = val(a[1]) & val(a[2])
        elif op == "mov.b32":
            lo, hi = args.split("}")[0].strip("{ ").split(",")
            r = val(args.split("}")[1].strip(", "))
            outs[int(lo.strip()[1:])], outs[int(hi.strip()[1:])] = r & 0xFFFF, r >> 16
    return [outs[j] for j in range(n_out)]


def test_unpack_ptx_gives_1024_plus_scaled_codes():
    """The GPU's unpack (inline PTX, which the interpreter cannot run), emulated on random words: output j is the
    fp16 1024 + code_j * 2**e_j (code j at bit bits * j, the cache's order), one prmt a byte and one lop3 a pair."""
    import numpy as np

    from moend_fx.kernels.triton_unpack import exponents, unpack_asm

    gen = torch.Generator().manual_seed(0)
    for bits in (2, 4, 8):
        asm = unpack_asm(bits)
        assert "cvt" not in asm and "shr" not in asm
        assert asm.count("prmt.b32") == (2 if bits == 8 else 4) and asm.count("lop3.b32") == (0 if bits == 8 else
                                                                                              16 // bits)
        for word in torch.randint(0, 2**32, (50,), generator=gen, dtype=torch.int64).tolist():
            got = np.array(_run_ptx(asm, word), dtype=np.uint16).view(np.float16).astype(np.float64)
            codes = [(word >> bits * j) & ((1 << bits) - 1) for j in range(32 // bits)]
            want = [1024 + c * 2**e for c, e in zip(codes, exponents(bits), strict=True)]
            assert got.tolist() == want, (bits, hex(word))
