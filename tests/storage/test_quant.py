import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moend_fx.common.errors import MoendError
from moend_fx.common.options import QuantMode
from moend_fx.storage.quant import dequantize, pack, packed_width, quantize, scale_shape, unpack

BITS = st.sampled_from([2, 4, 8])


@given(bits=BITS, rows=st.integers(1, 4), n=st.integers(1, 67), seed=st.integers(0, 2**16))
def test_pack_unpack_bijection(bits, rows, n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (rows, n), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape[-1] == packed_width(n, bits) == math.ceil(n * bits / 8)
    assert torch.equal(unpack(packed, bits, n), codes)
    # and the other way: every byte pattern unpacks and re-packs to itself (when n fills the bytes)
    raw = torch.randint(0, 256, (rows, 3), generator=g, dtype=torch.uint8)
    assert torch.equal(pack(unpack(raw, bits, 3 * 8 // bits), bits), raw)


def test_pack_bit_layout_is_documented_one():
    # value j of a byte sits at bit offset bits * j (docs/cache-format.md)
    codes = torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8)
    assert pack(codes, 2).item() == 1 | 2 << 2 | 3 << 4
    assert pack(torch.tensor([[0xA, 0x5]], dtype=torch.uint8), 4).item() == 0x5A


@given(
    bits=BITS, mode=st.sampled_from(["channel", "token"]), groups=st.integers(1, 3),
    d=st.sampled_from([16, 32, 64]), g=st.sampled_from([8, 16, 32]), seed=st.integers(0, 2**16),
    scale=st.floats(0.01, 50.0),
)
def test_dequantize_error_within_step_bound(bits, mode, groups, d, g, seed, scale):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, groups * g, d, generator=gen) * scale + torch.randn(1, generator=gen)
    q = quantize(x, bits, g, mode)
    y = dequantize(q)
    assert y.shape == x.shape
    if mode == "channel":
        step = q.scale.float().repeat_interleave(g, dim=2)
        zero = q.zero.float().repeat_interleave(g, dim=2)
    else:
        gv = min(g, d)
        step = q.scale.float().repeat_interleave(gv, dim=3)
        zero = q.zero.float().repeat_interleave(gv, dim=3)
    # Half a quantization step, plus the fp16 rounding of the stored zero (relative 2^-11) that can push
    # the group's min below the grid, plus fp32 rounding slack.
    bound = step / 2 + zero.abs() * 2**-11 + 1e-5 * x.abs().amax()
    assert ((x - y).abs() <= bound).all()


@pytest.mark.parametrize("bits,floor_db", [(8, 40.0), (4, 18.0), (2, 5.0)])
@pytest.mark.parametrize("mode", ["channel", "token"])
def test_snr_floor_per_bit_width(bits, floor_db, mode):
    # Gaussian data with per-channel offsets, like real keys; SNR floors from the issue (2-bit: ours).
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(1, 4, 256, 64, generator=gen) + 3 * torch.randn(1, 1, 1, 64, generator=gen)
    y = dequantize(quantize(x, bits, 32, mode))
    snr = 10 * torch.log10(x.pow(2).mean() / (x - y).pow(2).mean())
    assert snr >= floor_db


def test_constant_group_decodes_exactly():
    x = torch.full((1, 1, 32, 16), 1.25)
    assert torch.equal(dequantize(quantize(x, 4, 32, "channel")), x)


def test_custom_op_is_one_fx_node():
    q = quantize(torch.randn(1, 2, 32, 16), 4, 32, "channel")

    def f(codes, s, z):
        return torch.ops.moend.dequantize(codes, s, z, 4, 32, 0, 16, torch.float32) * 2

    gm = torch.fx.symbolic_trace(f)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.moend.dequantize.default in targets or torch.ops.moend.dequantize in targets
    torch.testing.assert_close(gm(q.codes, q.scale, q.zero), dequantize(q) * 2)


def test_custom_op_under_torch_compile_fake_tensor():
    q = quantize(torch.randn(1, 2, 64, 16), 8, 32, "token")
    compiled = torch.compile(lambda c, s, z: torch.ops.moend.dequantize(c, s, z, 8, 32, 1, 16, torch.float32),
                             backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q.codes, q.scale, q.zero), dequantize(q))


@pytest.mark.parametrize("bad", [3, 1, 16, 0])
def test_unknown_bits_rejected(bad):
    with pytest.raises(MoendError, match="allowed"):
        quantize(torch.randn(1, 1, 32, 16), bad)


def test_channel_mode_needs_full_groups():
    with pytest.raises(MoendError, match="multiple of group_size"):
        quantize(torch.randn(1, 1, 33, 16), 4, 32, "channel")


def test_non_finite_rejected():
    x = torch.randn(1, 1, 32, 16)
    x[0, 0, 3, 2] = float("inf")
    with pytest.raises(MoendError, match="finite"):
        quantize(x, 8)


@pytest.mark.parametrize("mode", [QuantMode.CHANNEL, QuantMode.TOKEN])
def test_mode_enum_or_string_and_scale_shape(mode):
    x = torch.randn(2, 3, 64, 16)
    q = quantize(x, 4, 32, mode)
    same = quantize(x, 4, 32, str(mode))  # the plain string users pass
    assert q.mode is mode and same.mode is mode and all(torch.equal(a, b) for a, b in zip(q.tensors(), same.tensors()))
    assert q.scale.shape == q.zero.shape == scale_shape(mode, 2, 3, 64, 16, 32)
    with pytest.raises(MoendError, match="mode='row' is unknown; allowed: channel, token"):
        quantize(x, 4, 32, "row")


@pytest.mark.parametrize("mode", ["channel", "token"])
def test_concat_keeps_each_blocks_groups(mode):
    # Groups never span the two halves (64 tokens = 2 groups of 32), so quantizing at once gives the same bits.
    x = torch.randn(1, 2, 64, 16)
    both = quantize(x[:, :, :32], 8, 32, mode).concat(quantize(x[:, :, 32:], 8, 32, mode))
    once = quantize(x, 8, 32, mode)
    assert all(torch.equal(a, b) for a, b in zip(both.tensors(), once.tensors()))
    assert both.num_tokens == 64


@pytest.mark.parametrize("mode", list(QuantMode))
def test_quantized_tensors_own_their_storage(mode):
    """Codes, scales and zeros are never views: a compiled decode step with a symbolic batch guards a view on
    its base, and a concat's or take's tensors have none (tests/compile/test_compile_generate.py)."""
    x = torch.randn(2, 3, 64, 16, generator=torch.Generator().manual_seed(0))
    q = quantize(x, 4, 32, mode)
    assert all(t._base is None for t in (q.codes, q.scale, q.zero))
