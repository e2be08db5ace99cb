"""fuse_quantized_attention: one packed_attention node per quantized layer, SDPA kept for 16/16 layers and for
anything the kernel cannot express; the rewritten graph computes what the eager graph did."""

import pytest
import torch
import torch.nn.functional as F
from moend_fx.passes import PASSES, run_passes
from moend_fx.passes.common import META_LAYER, META_SKIP, META_VARIANT, is_dequantize, is_sdpa, value
from moend_fx.passes.fuse_quantized_attention import fuse_quantized_attention
from torch._dynamo.exc import BackendCompilerFailed

from moend_fx.attention.reference import reference_attention
from moend_fx.common.errors import MoendError
from moend_fx.compile.settings import BackendSettings
from moend_fx.kernels.ops import reference_packed_attention
from moend_fx.kernels.precision import FP32_RTOL, kernel_atol
from moend_fx.storage.quant import quantize
from tests.passes.toy_graphs import CONFIGS, HIDDEN, ToyDecoder, capture, make_cache, rand, targets

PACKED = "moend.packed_attention.default"
SDPA = "scaled_dot_product_attention"


def settings(**kw):
    return BackendSettings(inner="eager", **kw)


def fused_graph(fn, *args, **kw):
    return capture(fn, *args, transform=lambda gm: run_passes(gm, settings(**kw)))


def skip_reasons(gm):
    return [n.meta[META_SKIP] for n in gm.graph.nodes if META_SKIP in n.meta]


@pytest.mark.parametrize("tokens", [1, 3])  # decode step (no mask) and a chunk (bottom-right causal mask)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_packed_op_per_quantized_layer(tokens, dtype):
    model = ToyDecoder(3).to(dtype)
    cache = make_cache(CONFIGS["mixed"], dtype=dtype)  # k4/v8, 16/16, k16/v2
    x = rand(1, tokens, HIDDEN).to(dtype)
    gm, inputs, out = fused_graph(model, x, cache)
    t = targets(gm)
    assert t.count(PACKED) == 2 and t.count(SDPA) == 1
    assert not any(is_dequantize(n) for n in gm.graph.nodes)
    names = [n.name for n in gm.graph.nodes if str(n.target) == PACKED]
    assert names == ["attn_k4_v8_hd8_g32_layer0", "attn_k16_v2_hd8_g32_layer2"]
    sdpa = [n for n in gm.graph.nodes if is_sdpa(n)]
    assert [n.meta[META_LAYER] for n in sdpa] == [1]
    assert "both 16-bit" in sdpa[0].meta[META_SKIP]
    want = model(x, cache)
    # fp32: the fused kernel's online softmax vs SDPA on dequantized values (summation order only).
    # bf16: SDPA rounds its intermediates to bf16, the kernel accumulates in fp32 (~3 significant digits).
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out, want, **tol)
    torch.testing.assert_close(gm(*inputs)[0], want, **tol)


def test_16_bit_storage_is_read_through_its_cast_to_fp32():
    """An fp32 model stores raw K/V (residual windows, a 16-bit side) in fp16 and the graph widens them for SDPA
    (promoting cat, cast of a raw side's cat): the fused op takes the stored fp16 graph inputs themselves."""
    model = ToyDecoder(3)
    cache = make_cache(CONFIGS["mixed"])  # k4/v8, 16/16, k16/v2
    gm, _, _ = fused_graph(model, rand(1, 1, HIDDEN), cache)
    fused = [n for n in gm.graph.nodes if str(n.target) == PACKED]
    assert len(fused) == 2
    for node in fused:
        raw = [node.args[i] for i in (7, 8)] + ([node.args[1]] if node.meta[META_VARIANT].startswith("attn_k16")
                                              else [])
        assert all(a.op == "placeholder" and value(a).dtype == torch.float16 for a in raw)
    casts = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "to"]
    assert len(casts) == 2  # only the 16/16 layer's K and V (the cast of each cat), which SDPA still reads


def test_a_raw_side_stored_unlike_its_residual_is_not_fused():
    layer = make_cache(CONFIGS["two"])[0]  # k8/v4
    q = rand(1, 4, 1, 8)

    def fn(q, k_raw, k_res, v_codes, v_scale, v_zero, v_res):
        k = torch.cat([k_raw, k_res.float()], dim=2)  # fp32 raw K beside an fp16 residual
        v = torch.cat([torch.ops.moend.dequantize(v_codes, v_scale, v_zero, 4, 32, 1, 8, torch.float32),
                       v_res.float()], dim=2)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    k_raw = layer.dequantize()[0][:, :, :64]
    gm, _, _ = fused_graph(fn, q, k_raw, layer.k_res, *layer.v_packed.tensors(), layer.v_res)
    assert PACKED not in targets(gm)
    assert skip_reasons(gm) == ["raw K has dtype torch.float32, its residual window torch.float16"]


def test_matches_reference_attention_with_gqa_and_batch():
    cache = make_cache(CONFIGS["two"], batch=2, tokens=75)
    q = rand(2, 4, 1, 8, seed=5)

    def attn(q, layer):
        from moend_fx.attention.packed import packed_layer_attention

        return packed_layer_attention(q, layer, scale=0.2)

    for layer in cache:
        gm, inputs, out = fused_graph(attn, q, layer)
        assert targets(gm).count(PACKED) == 1 and SDPA not in targets(gm)
        # Kernel vs fp32 reference: same dequantized values, different summation order.
        torch.testing.assert_close(out, reference_attention(q, layer, scale=0.2), atol=1e-5, rtol=1e-4)


def _left_padded(batch, tokens, n, pads, heads=1, seed=0):
    """bool [batch, heads, tokens, n]: row b's first pads[b] slots hidden (left padding), plus a few random holes
    per head when heads > 1 (an evicting layer's gathered mask is per head)."""
    mask = torch.ones(batch, heads, tokens, n, dtype=torch.bool)
    for b, p in enumerate(pads):
        mask[b, ..., :p] = False
    if heads > 1:
        mask &= torch.rand(batch, heads, 1, n, generator=torch.Generator().manual_seed(seed)) > 0.2
    return mask


def _fused_nodes(gm):
    return [n for n in gm.graph.nodes if str(n.target) == PACKED]


@pytest.mark.parametrize("tokens", [1, 3])  # decode step (mask alone) and a chunk (mask & bottom-right causal)
def test_padding_mask_is_fused(tokens):
    """A left-padded batch gives SDPA a real mask: the op takes it (``mask``), the causal part stays ``causal``."""
    model = ToyDecoder(2)
    cache = make_cache(CONFIGS["two"], batch=2)  # k8/v4, k4/v2; 70 tokens = 64 packed + 6 residual
    x = rand(2, tokens, HIDDEN)
    mask = _left_padded(2, tokens, 70, pads=(0, 23))
    mask[1, :, 0] = False  # a query row that may attend nothing (a padding query): 0, like SDPA
    gm, inputs, out = fused_graph(model, x, cache, mask)
    t = targets(gm)
    assert t.count(PACKED) == 2 and SDPA not in t and not skip_reasons(gm)
    for node in _fused_nodes(gm):
        *_, causal, op_mask = node.args
        assert op_mask.op == "placeholder" and value(op_mask).shape == (2, 1, tokens, 70)  # the padding mask itself
        assert causal is (tokens > 1)  # L = 1 has no causal part
    assert not any(n.op == "call_method" and n.target == "tril" for n in gm.graph.nodes)  # the kernel's causal
    want = model(x, cache, mask)
    # fp32: the fused kernel's online softmax vs SDPA on the same dequantized values (summation order only).
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gm(*inputs)[0], want, atol=1e-4, rtol=1e-4)
    unmasked = model(x, cache)
    assert (want - unmasked).abs().max() > 1e-2  # the mask matters: the comparison above checks it is applied
    gm, _, out = fused_graph(model, x, cache, mask, kernel="reference")  # the traced reference takes it too
    assert sum(n.target is reference_packed_attention for n in gm.graph.nodes) == 2 and SDPA not in targets(gm)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)  # fp32, summation order


def test_per_head_and_broadcast_masks_are_fused():
    """A per-head mask [B, H, 1, n] (an evicting layer's, gathered at each head's kept slots) is passed as is; a
    padding mask that broadcasts over the chunk's queries ([B, 1, 1, n] & causal) is passed as the whole AND."""
    from moend_fx.attention.packed import packed_layer_attention

    layer = make_cache(CONFIGS["two"], batch=2)[0]
    for l, mask in ((1, _left_padded(2, 1, 70, pads=(5, 40), heads=4)), (3, _left_padded(2, 1, 70, pads=(7, 0)))):
        q = rand(2, 4, l, 8, seed=l)
        gm, inputs, out = fused_graph(lambda q, layer, mask: packed_layer_attention(q, layer, mask=mask),
                                      q, layer, mask)
        (node,) = _fused_nodes(gm)
        *_, causal, op_mask = node.args
        assert SDPA not in targets(gm) and value(op_mask).shape == (2, mask.shape[1], l, 70)
        assert causal is False  # L = 1: no causal part; L = 3: the AND (causal included) is the op's mask
        full = mask.expand(2, mask.shape[1], l, 70)
        # the C++ kernel vs the unfused graph (SDPA) and the reference on the same dequantized values: the int16
        # rounding of q*s on the 8-bit K side (3-sigma bound) + fp32 summation order (moend_fx/kernels/precision.py)
        atol = kernel_atol(q, layer)
        torch.testing.assert_close(out, packed_layer_attention(q, layer, mask=mask), atol=atol, rtol=FP32_RTOL)
        torch.testing.assert_close(out, reference_attention(q, layer, mask=full), atol=atol, rtol=FP32_RTOL)


@pytest.mark.parametrize("mask, reason", [
    (torch.zeros(2, 1, 1, 70), "attn_mask has dtype torch.float32 (an additive mask)"),
    (torch.ones(4, 1, 70, dtype=torch.bool), "attn_mask (4, 1, 70) is neither the bottom-right causal mask nor"),
    (torch.ones(1, 1, 1, 70, dtype=torch.bool), "attn_mask (1, 1, 1, 70) is neither"),  # broadcast over the batch
])
def test_masks_the_kernel_does_not_take_are_not_fused(mask, reason):
    from moend_fx.attention.packed import packed_layer_attention

    layer = make_cache(CONFIGS["two"], batch=2)[0]
    q = rand(2, 4, 1, 8)
    gm, _, out = fused_graph(lambda q, layer, mask: packed_layer_attention(q, layer, mask=mask), q, layer, mask)
    assert PACKED not in targets(gm) and SDPA in targets(gm)
    assert skip_reasons(gm)[0].startswith(reason)
    torch.testing.assert_close(out, packed_layer_attention(q, layer, mask=mask), atol=1e-6, rtol=1e-6)  # as is


def _manual(q, qt_k, k_res, qt_v, v_res, k_mode=0, v_mode=1, dim=2, **sdpa_kw):
    k = torch.cat([torch.ops.moend.dequantize(qt_k.codes, qt_k.scale, qt_k.zero, qt_k.bits, 32, k_mode, 8,
                                              torch.float32), k_res], dim=dim)
    v = torch.cat([torch.ops.moend.dequantize(qt_v.codes, qt_v.scale, qt_v.zero, qt_v.bits, 32, v_mode, 8,
                                              torch.float32), v_res], dim=dim)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **sdpa_kw)


@pytest.mark.parametrize("kw, reason", [
    (dict(is_causal=True), "is_causal=True"),
    (dict(dropout_p=0.5), "dropout_p=0.5"),
    (dict(k_mode=1), "K is quantized with mode 1"),
])
def test_patterns_the_kernel_cannot_express_are_not_fused(kw, reason):
    layer = make_cache(CONFIGS["two"])[0]
    q = rand(1, 4, 3, 8)
    qt_k = layer.k_packed
    if kw.get("k_mode") == 1:  # K grouped per token: valid codes, but not the kernel's layout for K
        qt_k = quantize(layer.dequantize()[0][:, :, :64], 8, 32, "token")
    args = (q, qt_k, layer.k_res, layer.v_packed, layer.v_res)
    gm, _, _ = capture(_manual, *args, transform=lambda gm: run_passes(gm, settings()), **kw)
    assert PACKED not in targets(gm) and SDPA in targets(gm)
    assert reason in skip_reasons(gm)[0]


def test_cat_along_another_axis_is_not_fused():
    layer = make_cache(CONFIGS["two"])[0]
    q = rand(1, 4, 2, 16)  # head_dim 16: the packed part's 8 channels, then 8 more from the cat

    def fn(q, k_codes, k_scale, k_zero, k_res):
        deq = torch.ops.moend.dequantize(k_codes, k_scale, k_zero, 8, 32, 0, 8, torch.float32)
        k = torch.cat([deq, k_res.expand(1, 2, 64, 8)], dim=3)  # [1, 2, 64, 16]: channels, not tokens, grow
        return F.scaled_dot_product_attention(q, k, k, enable_gqa=True)

    gm, _, _ = fused_graph(fn, q, layer.k_packed.codes, layer.k_packed.scale, layer.k_packed.zero,
                           layer.k_res[:, :, :1])
    assert PACKED not in targets(gm) and SDPA in targets(gm)
    assert skip_reasons(gm) == ["K is concatenated along dim 3, not the token axis 2"]


def test_fuse_false_and_reference_kernel():
    model, cache, x = ToyDecoder(2), make_cache(CONFIGS["two"]), rand(1, 3, HIDDEN)
    gm, _, _ = fused_graph(model, x, cache, fuse=False)
    assert PACKED not in targets(gm) and targets(gm).count(SDPA) == 2
    gm, inputs, out = fused_graph(model, x, cache, kernel="reference")
    fused = [n for n in gm.graph.nodes if n.target is reference_packed_attention]
    assert [n.meta[META_VARIANT] for n in fused] == ["attn_k8_v4_hd8_g32", "attn_k4_v2_hd8_g32"]
    torch.testing.assert_close(out, model(x, cache), atol=1e-5, rtol=1e-4)  # fp32, summation order


def test_triton_kernel_on_cpu_tensors_is_an_error():
    # dynamo wraps a backend's exception in BackendCompilerFailed; the MoendError is its inner_exception.
    with pytest.raises(BackendCompilerFailed) as e:
        fused_graph(ToyDecoder(2), rand(1, 1, HIDDEN), make_cache(CONFIGS["two"]), kernel="triton")
    assert isinstance(e.value.inner_exception, MoendError)
    assert "kernel='triton'" in str(e.value) and "allowed here" in str(e.value)


def test_running_the_passes_twice_changes_nothing():
    gm, inputs, _ = fused_graph(ToyDecoder(2), rand(1, 1, HIDDEN), make_cache(CONFIGS["two"]))
    before = str(gm.graph)
    for p in PASSES:
        gm = p(gm, settings())
    assert str(gm.graph) == before


def test_pass_alone_needs_find_attention_tags():
    # Without find_attention's tags the pass has nothing to fuse: the order in PASSES matters.
    gm, _, _ = capture(ToyDecoder(2), rand(1, 1, HIDDEN), make_cache(CONFIGS["two"]))
    # The captured graph holds the fusable pattern: two SDPA nodes reading packed K/V through dequantize.
    assert targets(gm).count(SDPA) == 2 and sum(is_dequantize(n) for n in gm.graph.nodes) == 4
    fuse_quantized_attention(gm, settings())
    assert PACKED not in targets(gm) and targets(gm).count(SDPA) == 2
