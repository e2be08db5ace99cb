"""torch.ops.moend.packed_attention and the fused C++ CPU kernel against the reference attention."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moend_fx.attention.reference import reference_attention
from moend_fx.common.errors import MoendError
from moend_fx.kernels import cpu, layer_tensors, packed_attention, variant_name
from moend_fx.kernels.ops import reference_packed_attention
from moend_fx.kernels.precision import FP32_RTOL, kernel_atol
from moend_fx.plan.routing import LayerConfig
from moend_fx.storage.packed import PackedKV
from tests.kernels.masks import mask_kinds, padding_mask

BITS = st.sampled_from([2, 4, 8, 16])


def make_layer(seed, b, hkv, n, d, kb, vb, g=32, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    # Offsets and scales differ per channel like real keys (outlier channels), never zeros.
    k = torch.randn(b, hkv, n, d, generator=gen) * (1 + 3 * torch.rand(d, generator=gen)) + 0.5
    v = torch.randn(b, hkv, n, d, generator=gen)
    return PackedKV.from_dense(k.to(dtype), v.to(dtype), LayerConfig(1.0, kb, vb), g)


@st.composite
def cases(draw):
    kb, vb = draw(BITS), draw(BITS)
    d = draw(st.sampled_from([16, 32, 64]))
    g = 32
    p = draw(st.sampled_from([0, g, 3 * g]))
    r = draw(st.integers(0, g - 1))
    l = draw(st.sampled_from([1, 3]))
    if p + r < l:
        r = l
    hkv = draw(st.sampled_from([1, 2]))
    ratio = draw(st.sampled_from([1, 3, 4]))
    b = draw(st.sampled_from([1, 2]))
    return dict(kb=kb, vb=vb, d=d, g=g, n=p + r, l=l, hkv=hkv, h=hkv * ratio, b=b, seed=draw(st.integers(0, 99)))


def _run(c, kernel, num_splits=0):
    """(out, ref, atol): atol is the C++ kernel's tolerance (int16 rounding of q*s on a quantized K side plus
    fp32 reordering; moend_fx/kernels/precision.py)."""
    layer = make_layer(c["seed"], c["b"], c["hkv"], c["n"], c["d"], c["kb"], c["vb"], c["g"])
    q = torch.randn(c["b"], c["h"], c["l"], c["d"], generator=torch.Generator().manual_seed(c["seed"] + 1))
    ref = reference_attention(q, layer)
    out = packed_attention(q, layer, kernel=kernel, num_splits=num_splits)
    return out, ref, kernel_atol(q, layer)


@given(cases())
def test_cpu_kernel_matches_reference(c):
    assert cpu.available(), cpu.build_error()
    out, ref, atol = _run(c, "cpu")
    # Same dequantized values; the K side dots an int16-rounded q*s (3-sigma bound), the rest is fp32 summation
    # order (blocks, online softmax) and the polynomial exp (rel. error ~1e-7).
    torch.testing.assert_close(out, ref, atol=atol, rtol=FP32_RTOL)


@given(cases(), st.sampled_from([2, 3, 5]))
def test_cpu_kernel_token_splits_merge_exactly(c, splits):
    out, ref, atol = _run(c, "cpu", num_splits=splits)
    # Split-K partials merged by log-sum-exp: the same tolerance as above.
    torch.testing.assert_close(out, ref, atol=atol, rtol=FP32_RTOL)


@given(cases())
def test_op_auto_and_reference_paths(c):
    out, ref, atol = _run(c, "auto")
    torch.testing.assert_close(out, ref, atol=atol, rtol=FP32_RTOL)  # C++ kernel on CPU: as above
    out_ref, _, _ = _run(c, "reference")
    torch.testing.assert_close(out_ref, ref, atol=1e-6, rtol=1e-5)  # same maths, different concat order


@given(cases(), mask_kinds())
def test_every_path_takes_the_padding_mask(c, m):
    """auto (the op), cpu and reference with a padding mask [B, 1 or H, L, S] give the reference's answer."""
    layer = make_layer(c["seed"], c["b"], c["hkv"], c["n"], c["d"], c["kb"], c["vb"], c["g"])
    q = torch.randn(c["b"], c["h"], c["l"], c["d"], generator=torch.Generator().manual_seed(c["seed"] + 1))
    mask = padding_mask(m[1], c["b"], c["h"], c["l"], c["n"], m[0])
    ref = reference_attention(q, layer, mask=mask)
    for kernel in ("auto", "cpu"):
        out = packed_attention(q, layer, kernel=kernel, mask=mask)
        # the C++ kernel: int16 q*s on the K side (3-sigma bound) + fp32 reordering (moend_fx/kernels/precision.py)
        torch.testing.assert_close(out, ref, atol=kernel_atol(q, layer), rtol=FP32_RTOL)
    out = packed_attention(q, layer, kernel="reference", mask=mask)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)  # same maths, different concat order


def test_rows_the_mask_hides_everything_from_give_zeros():
    """A query row that may attend no token (a padding query, or a mask hiding the whole row) gives 0, never NaN,
    on every path; the other rows are unaffected."""
    layer = make_layer(8, 2, 2, 3 * 32 + 9, 32, 4, 8)
    q = torch.randn(2, 6, 3, 32)
    mask = torch.ones(2, 6, 3, 105, dtype=torch.bool)
    mask[0] = False  # batch row 0 sees nothing: every block is skipped
    mask[1, 2, 0] = False  # one (head, query) row of batch row 1
    mask[1, :, :, :40] = False  # left padding of batch row 1
    ref = reference_attention(q, layer, mask=mask)
    for kernel in ("auto", "cpu", "reference"):
        out = packed_attention(q, layer, kernel=kernel, mask=mask)
        assert not out.isnan().any()
        assert out[0].abs().max() == 0 and out[1, 2, 0].abs().max() == 0
        # int16 q*s on the K side + fp32 reordering (moend_fx/kernels/precision.py)
        torch.testing.assert_close(out, ref, atol=kernel_atol(q, layer), rtol=FP32_RTOL)


def test_a_sliced_or_broadcast_mask_is_read_in_place():
    """The cache slices HF's logical mask to the held tokens (``mask[..., :n]``: strided rows) and a mask may be
    broadcast over heads or batch (stride 0): the kernel reads either, and a transposed one after a copy."""
    layer = make_layer(9, 2, 1, 70, 16, 8, 4)
    q = torch.randn(2, 3, 2, 16)
    logical = torch.rand(2, 1, 2, 90, generator=torch.Generator().manual_seed(3)) > 0.4
    sliced = logical[..., :70]
    broadcast = torch.ones(1, 1, 2, 70, dtype=torch.bool).tril(68).expand(2, 3, 2, 70)
    transposed = logical[..., :70].transpose(-1, -2).contiguous().transpose(-1, -2)
    for mask in (sliced, broadcast, transposed):
        ref = reference_attention(q, layer, mask=mask.contiguous())
        out = packed_attention(q, layer, kernel="cpu", mask=mask)
        # int16 q*s on the 8-bit K side + fp32 reordering (moend_fx/kernels/precision.py)
        torch.testing.assert_close(out, ref, atol=kernel_atol(q, layer), rtol=FP32_RTOL)


@pytest.mark.parametrize("mask, match", [
    (torch.ones(1, 1, 1, 40), r"mask must be bool \[B, 1 or H, L, S\] = \[1, 1 or 4, 1, 40\] .*; got torch.float32"),
    (torch.ones(1, 1, 1, 39, dtype=torch.bool), r"got torch.bool \(1, 1, 1, 39\)"),
    (torch.ones(1, 2, 1, 40, dtype=torch.bool), r"1 or 4, 1, 40\] .*got torch.bool \(1, 2, 1, 40\)"),  # Hkv heads
    (torch.ones(1, 40, dtype=torch.bool), r"got torch.bool \(1, 40\)"),
])
def test_bad_masks_raise_moend_error(mask, match):
    layer = make_layer(4, 1, 2, 40, 16, 4, 4)
    q = torch.randn(1, 4, 1, 16)
    for kernel in ("auto", "cpu", "reference"):
        with pytest.raises(MoendError, match=match):
            packed_attention(q, layer, kernel=kernel, mask=mask)


def test_long_decode_many_splits():
    # SmolLM2 decode shape with a long kept length, so the automatic split count is > 1.
    layer = make_layer(0, 1, 3, 4096 + 7, 64, 4, 8)
    q = torch.randn(1, 9, 1, 64)
    out = packed_attention(q, layer, kernel="cpu")
    # int16 q*s on the K side + fp32 reordering (moend_fx/kernels/precision.py)
    torch.testing.assert_close(out, reference_attention(q, layer), atol=kernel_atol(q, layer), rtol=FP32_RTOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_dtype(dtype):
    layer = make_layer(3, 1, 2, 70, 32, 16, 4, dtype=dtype)
    q = torch.randn(1, 4, 2, 32).to(dtype)
    out = packed_attention(q, layer, kernel="cpu")
    assert out.dtype == dtype
    # Both paths accumulate in fp32 from the same half-precision inputs; the output rounding to dtype
    # (bf16: 8 bits of mantissa) dominates.
    torch.testing.assert_close(out.float(), reference_attention(q, layer).float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("kb, vb", [(16, 4), (8, 16), (16, 16)])
def test_fp32_query_over_16_bit_storage(kb, vb):
    """An fp32 model's layer keeps raw K/V in fp16: every path reads them as stored and answers in fp32."""
    layer = make_layer(6, 1, 2, 70, 32, kb, vb)
    assert layer.k_res.dtype == torch.float16 and layer.dtype == torch.float32
    q = torch.randn(1, 4, 2, 32)
    ref = reference_attention(q, layer)
    for kernel in ("cpu", "auto", "reference"):
        out = packed_attention(q, layer, kernel=kernel)
        assert out.dtype == torch.float32
        # the same fp16 values widened: fp32 reordering (+ the int16 q*s of an 8-bit K side, tolerance.py)
        atol = kernel_atol(q, layer) if kernel != "reference" else 1e-5
        torch.testing.assert_close(out, ref, atol=atol, rtol=FP32_RTOL)


def test_raw_side_stored_unlike_its_residual_is_an_error():
    layer = make_layer(7, 1, 2, 70, 32, 16, 4)
    t = list(layer_tensors(layer))
    t[0] = t[0].float()  # raw K in fp32 beside an fp16 residual window: the kernels read one type per side
    with pytest.raises(MoendError, match="k_packed .16-bit, raw. must be a float type, that of k_res"):
        torch.ops.moend.packed_attention(torch.randn(1, 4, 1, 32), *t, 16, 4, 32, 0.25, True)


def test_custom_scale_and_no_causal_chunk():
    layer = make_layer(5, 1, 1, 40, 16, 8, 8)
    q = torch.randn(1, 2, 4, 16)
    for causal in (True, False):
        out = packed_attention(q, layer, scale=0.3, causal=causal, kernel="cpu")
        ref = reference_attention(q, layer, scale=0.3, causal_chunk=causal)
        # int16 q*s on the 8-bit K side + fp32 reordering (moend_fx/kernels/precision.py)
        torch.testing.assert_close(out, ref, atol=kernel_atol(q, layer, scale=0.3), rtol=FP32_RTOL)


def test_failing_build_falls_back_to_reference(monkeypatch):
    layer = make_layer(1, 1, 1, 45, 16, 4, 4)
    q = torch.randn(1, 2, 1, 16)

    def broken():
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cpu, "_compile", broken)
    cpu._reset()
    try:
        with pytest.warns(RuntimeWarning, match="no compiler here"):
            out = torch.ops.moend.packed_attention(q, *layer_tensors(layer), 4, 4, 32, 0.25, True)
        assert not cpu.available() and "no compiler" in cpu.build_error()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once only
            out2 = packed_attention(q, layer, kernel="cpu", scale=0.25)
        ref = reference_attention(q, layer, scale=0.25)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)  # it is the reference
        torch.testing.assert_close(out2, ref, atol=1e-6, rtol=1e-5)
    finally:
        cpu._reset()  # the next call (monkeypatch undone) loads the cached build again


def test_build_error_summary_shows_the_compiler_error_not_the_command():
    # torch's message: the ninja command lines (thousands of characters of flags), then the compiler's output
    command = "[1/2] /usr/bin/g++ -MMD " + " ".join(f"-isystem /include/{i}" for i in range(200))
    err = (f"RuntimeError: Error building extension 'moend_attn_x': {command}\n"
           "moend_attn.cpp:3:10: fatal error: Python.h: No such file or directory\ncompilation terminated.\n")
    assert cpu.error_summary(err) == "moend_attn.cpp:3:10: fatal error: Python.h: No such file or directory"
    tail = cpu.error_summary("x" * 900 + " the end")  # no error: line: the end of the message, within the limit
    assert tail.endswith(" the end") and len(tail) == 503


def test_fake_impl_and_opcheck():
    layer = make_layer(2, 1, 2, 70, 32, 4, 8)
    q = torch.randn(1, 4, 1, 32)
    args = (q, *layer_tensors(layer), 4, 8, 32, 1 / math.sqrt(32), True)
    torch.library.opcheck(torch.ops.moend.packed_attention.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    mask = torch.ones(1, 1, 1, 70, dtype=torch.bool)
    mask[..., :9] = False
    torch.library.opcheck(torch.ops.moend.packed_attention.default, (*args, mask),
                          test_utils=("test_schema", "test_faketensor"))
    assert "Tensor? mask=None" in str(torch.ops.moend.packed_attention.default._schema)
    # a chunk's q as a decoder makes it (transposed from [B, L, H, D]): the kernels answer contiguous, and so must
    # the fake (inductor asserts the real output's strides against it)
    qt = torch.randn(1, 2, 4, 32).transpose(1, 2)
    torch.library.opcheck(torch.ops.moend.packed_attention.default, (qt, *args[1:]), test_utils=("test_faketensor",))


def test_variant_name():
    assert variant_name(4, 8, 64, 32) == "attn_k4_v8_hd64_g32"
    with pytest.raises(MoendError, match="k_bits=3"):
        variant_name(3, 8, 64, 32)
    with pytest.raises(MoendError, match="group_size"):
        variant_name(4, 8, 64, 24)


def test_bad_inputs_raise_moend_error():
    layer = make_layer(4, 1, 2, 40, 16, 4, 4)
    with pytest.raises(MoendError, match="kernel='fast'"):
        packed_attention(torch.randn(1, 4, 1, 16), layer, kernel="fast")
    with pytest.raises(MoendError, match="multiple of KV heads"):
        packed_attention(torch.randn(1, 3, 1, 16), layer)
    with pytest.raises(MoendError, match="q must be"):
        packed_attention(torch.randn(4, 1, 16), layer, kernel="cpu")
    with pytest.raises(MoendError, match="chunk of 41"):
        packed_attention(torch.randn(1, 2, 41, 16), layer, kernel="cpu")
    t = list(layer_tensors(layer))
    t[0] = t[0][..., :-1]  # truncated K codes
    with pytest.raises(MoendError, match="k_packed"):
        torch.ops.moend.packed_attention(torch.randn(1, 2, 1, 16), *t, 4, 4, 32, 0.25, True)


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layer = make_layer(4, 1, 1, 40, 16, 4, 4)
    with pytest.raises(MoendError, match="TRITON_INTERPRET"):
        packed_attention(torch.randn(1, 1, 1, 16), layer, kernel="triton")


@pytest.mark.parametrize("kb, vb", [(4, 4), (16, 2), (2, 8)])
def test_both_v_layouts_match_the_reference(kb, vb):
    """The op reads V split like K (P packed tokens + an R-token raw residual) or packed on arrival (P + R packed,
    no residual: what the cache stores for a quantized V); the C++ kernel matches the reference on both."""
    layer = make_layer(11, 2, 2, 3 * 32 + 13, 64, kb, vb)
    p, r = layer.num_packed, layer.k_res.shape[2]
    assert layer.v_packed.num_tokens == p + r and layer.v_res.shape[2] == 0  # stored on arrival
    t = list(layer_tensors(layer))
    v_full = layer.dequantize(torch.float32)[1]
    split = t[:3] + [x[:, :, :p] for x in t[3:6]] + [t[6], v_full[:, :, p:].half()]
    q = torch.randn(2, 6, 1, 64, generator=torch.Generator().manual_seed(12))
    atol = kernel_atol(q, layer)  # the C++ kernel's tolerance (int16 rounding of q*s, fp32 reordering)
    for args in (t, split):
        out = torch.ops.moend.packed_attention.default(q, *args, kb, vb, 32, 0.125, True)
        want = reference_packed_attention(q, *args, kb, vb, 32, 0.125, True)
        torch.testing.assert_close(out, want, rtol=FP32_RTOL, atol=atol)
    # the same V values (the split residual is the dequantized codes rounded to fp16), so the same output up to
    # that rounding: at most 2^-11 of the largest |V| (a convex combination of values each off by that much)
    a = reference_packed_attention(q, *t, kb, vb, 32, 0.125, True)
    b = reference_packed_attention(q, *split, kb, vb, 32, 0.125, True)
    torch.testing.assert_close(a, b, rtol=0, atol=float(v_full.abs().max()) * 2**-11)
    bad = split[:-1] + [split[-1][:, :, :5]]
    with pytest.raises(MoendError, match="v_res"):
        torch.ops.moend.packed_attention(q, *bad, kb, vb, 32, 0.125, True)
