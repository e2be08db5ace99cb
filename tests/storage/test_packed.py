import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moend_fx.common.errors import MoendError
from moend_fx.plan.memory import layer_bytes
from moend_fx.plan.routing import Grid, LayerConfig
from moend_fx.storage.packed import PackedKV
from moend_fx.storage.tokens import gather_tokens

CONFIGS = Grid(k_bits=(16, 8, 4, 2), v_bits=(16, 8, 4, 2)).configs


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_lossless_is_exact_up_to_its_16_bit_storage():
    """An fp32 layer stores K/V as their fp16 copy and gives that back exactly, in fp32."""
    k, v = rand(2, 3, 45, 16, seed=1), rand(2, 3, 45, 16, seed=2)
    layer = PackedKV.from_dense(k, v, LayerConfig(1.0, 16, 16))
    k2, v2 = layer.dequantize()
    assert k2.dtype == torch.float32 and layer.dtype == torch.float32 and layer.k_res.dtype == torch.float16
    assert torch.equal(k2, k.half().float()) and torch.equal(v2, v.half().float())
    assert layer.positions is None and layer.num_packed == 0


@pytest.mark.parametrize("dtype, stored", [(torch.float32, torch.float16), (torch.float16, torch.float16),
                                           (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("config", [LayerConfig(1.0, 16, 16), LayerConfig(0.5, 16, 4), LayerConfig(0.5, 8, 16)])
def test_raw_sides_and_residual_are_stored_in_16_bits(dtype, stored, config):
    k, v = rand(2, 3, 70, 16, seed=1).to(dtype), rand(2, 3, 70, 16, seed=2).to(dtype)
    pos = torch.arange(70).expand(2, 3, 70) if config.evicts else None
    layer = PackedKV.from_dense(k, v, config, 32, pos)
    raw = [b for b in layer.blocks() if isinstance(b, torch.Tensor)] + list(layer.residuals())
    assert len(raw) == 2 + (config.k_bits == 16) + (config.v_bits == 16)
    assert all(t.dtype == stored for t in raw) and layer.raw_dtype == stored
    assert all(t.dtype == dtype for t in layer.dequantize())  # handed back in the model's dtype
    grown = layer.append(k[:, :, :3], v[:, :, :3], pos[..., :3] if config.evicts else None)
    assert grown.k_res.dtype == stored and grown.dtype == dtype
    assert layer.nbytes() == layer_bytes(config, 70, kv_heads=3, head_dim=16, batch=2, dtype=dtype, kept=70)


def test_positions_are_int16_until_the_context_outgrows_it():
    """int16 while every position fits (slots 0..32767), int32 after; an append that crosses the line widens the
    stored positions, and the bytes follow the memory model either side of it."""
    config = LayerConfig(0.5, 4, 4)
    n = 40
    k, v = rand(1, 2, n + 2, 16, seed=3), rand(1, 2, n + 2, 16, seed=4)
    below = torch.arange(32768 - n, 32768).expand(1, 2, n)  # largest position 32767
    layer = PackedKV.from_dense(k[:, :, :n], v[:, :, :n], config, 32, below)
    assert layer.positions.dtype == torch.int16 and torch.equal(layer.positions.long(), below)
    assert layer.nbytes() == layer_bytes(config, 0, kv_heads=2, head_dim=16, kept=n, slots=32768)
    new = torch.tensor([32768, 32769], dtype=torch.int32).expand(1, 2, 2)  # what the cache layer makes there
    grown = layer.append(k[:, :, n:], v[:, :, n:], new)
    assert grown.positions.dtype == torch.int32 and grown.positions[0, 0, -3:].tolist() == [32767, 32768, 32769]
    assert grown.nbytes() == layer_bytes(config, 0, kv_heads=2, head_dim=16, kept=n + 2, slots=32770)
    above = PackedKV.from_dense(k[:, :, :n], v[:, :, :n], config, 32, below + 1)  # largest position 32768
    assert above.positions.dtype == torch.int32


@given(config=st.sampled_from(CONFIGS), n0=st.integers(1, 70), steps=st.lists(st.integers(1, 9), max_size=8),
       seed=st.integers(0, 999))
def test_append_matches_one_shot_and_memory_model(config, n0, steps, seed):
    """Appending tokens chunk by chunk stores the same bytes, and the same values, as compressing at once."""
    total = n0 + sum(steps)
    k, v = rand(1, 2, total, 16, seed=seed), rand(1, 2, total, 16, seed=seed + 1)
    pos = torch.arange(total).expand(1, 2, total)
    layer = PackedKV.from_dense(k[:, :, :n0], v[:, :, :n0], config, 16, pos[..., :n0] if config.evicts else None)
    at = n0
    for s in steps:
        layer = layer.append(k[:, :, at:at + s], v[:, :, at:at + s], pos[..., at:at + s])
        at += s
    once = PackedKV.from_dense(k, v, config, 16, pos if config.evicts else None)
    assert layer.num_tokens == total and layer.num_packed == once.num_packed
    assert layer.nbytes() == once.nbytes() == layer_bytes(config, total, kv_heads=2, head_dim=16,
                                                          group_size=16, kept=total)
    # Groups are quantized from the same tokens either way, so the values agree exactly.
    for a, b in zip(layer.dequantize(), once.dequantize()):
        assert torch.equal(a, b)
    if config.evicts:
        assert torch.equal(layer.positions, pos.to(torch.int16))


@given(config=st.sampled_from(CONFIGS), n0=st.integers(1, 70), steps=st.lists(st.integers(1, 9), max_size=8),
       seed=st.integers(0, 999))
def test_lazy_flush_keeps_one_full_group_then_flush_equals_eager(config, n0, steps, seed):
    """append(keep_full=True) leaves 1..G tokens in the residual; flush() then gives the eager layout exactly."""
    g = 16
    total = n0 + sum(steps)
    k, v = rand(1, 2, total, 16, seed=seed), rand(1, 2, total, 16, seed=seed + 1)
    pos = torch.arange(total).expand(1, 2, total)
    lazy = eager = PackedKV.from_dense(k[:, :, :n0], v[:, :, :n0], config, g, pos[..., :n0] if config.evicts else None)
    at = n0
    for s in steps:
        lazy = lazy.flush().append(k[:, :, at:at + s], v[:, :, at:at + s], pos[..., at:at + s], keep_full=True)
        eager = eager.append(k[:, :, at:at + s], v[:, :, at:at + s], pos[..., at:at + s])
        at += s
        if config.quantized:
            assert 1 <= lazy.k_res.shape[2] <= g
    settled = lazy.flush()
    assert settled.num_packed == eager.num_packed and settled.nbytes() == eager.nbytes()
    for a, b in zip(settled.dequantize(), eager.dequantize()):
        assert torch.equal(a, b)  # the same groups quantized from the same tokens


@pytest.mark.parametrize("r", [0, 1, 5, 31])
def test_residual_strides_do_not_depend_on_its_length(r):
    """Token-major residual (strides (H*D, D, B*H*D, 1) at every R, a fresh storage): one compiled decode graph
    serves every residual length. An empty packed part has the plain row-major products as strides."""
    k, v = rand(2, 3, 64 + r, 16, seed=5), rand(2, 3, 64 + r, 16, seed=6)
    layer = PackedKV.from_dense(k, v, LayerConfig(1.0, 4, 8), 32)
    assert layer.k_res.shape == (2, 3, r, 16) and layer.k_res.stride() == (48, 16, 96, 1)
    assert layer.k_res.storage_offset() == 0 and torch.equal(layer.k_res, k[:, :, 64:].half())
    grown = layer.append(k[:, :, :1], v[:, :, :1])
    assert grown.k_res.stride() == (48, 16, 96, 1)
    empty = PackedKV.from_dense(k[:, :, :5], v[:, :, :5], LayerConfig(1.0, 4, 8), 32)
    assert empty.k_packed.codes.shape == (2, 3, 0, 8) and empty.k_packed.codes.stride() == (0, 0, 8, 1)
    # a quantized V is packed on arrival: all 5 tokens are codes, and its (empty) residual is token-major too
    assert empty.v_packed.num_tokens == 5 and empty.v_res.shape == (2, 3, 0, 16)
    assert empty.v_res.stride() == (48, 16, 96, 1) and grown.v_res.stride() == (48, 16, 96, 1)
    raw_v = PackedKV.from_dense(k[:, :, :5], v[:, :, :5], LayerConfig(1.0, 4, 16), 32)
    assert raw_v.v_packed.shape == (2, 3, 0, 16) and raw_v.v_packed.stride() == (0, 0, 16, 1)


def test_quantized_v_is_packed_on_arrival():
    """A quantized V holds no residual: every token's V is codes as soon as it arrives, the same codes whether the
    tokens came in one call or one at a time, and the bytes are the memory model's at every length."""
    k, v = rand(1, 2, 45, 16, seed=7), rand(1, 2, 45, 16, seed=8)
    cfg = LayerConfig(1.0, 4, 2)
    whole = PackedKV.from_dense(k, v, cfg, 16)
    grown = PackedKV.from_dense(k[:, :, :3], v[:, :, :3], cfg, 16)
    for t in range(3, 45):
        grown = grown.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert grown.v_packed.num_tokens == t + 1 and grown.v_res.shape[2] == 0
        assert grown.nbytes() == layer_bytes(cfg, t + 1, kv_heads=2, head_dim=16, group_size=16, dtype=k.dtype)
    assert whole.v_packed.num_tokens == 45 and whole.k_res.shape[2] == 45 - 32
    for a, b in zip(whole.v_packed.tensors(), grown.v_packed.tensors()):
        assert torch.equal(a, b)
    # the residual window's V is quantized: its error is that of 2-bit codes, not 0
    v_err = (whole.dequantize()[1][:, :, 32:] - v[:, :, 32:]).abs().max()
    assert v_err > 0


def test_gather_tokens_keeps_positions_and_values():
    k, v = rand(1, 2, 64, 16, seed=3), rand(1, 2, 64, 16, seed=4)
    pos = (torch.arange(64) * 3).expand(1, 2, 64)
    idx = torch.stack([torch.arange(0, 64, 2), torch.arange(1, 64, 2)]).unsqueeze(0)
    kept = PackedKV.from_dense(gather_tokens(k, idx), gather_tokens(v, idx), LayerConfig(0.5, 16, 16), 32,
                               gather_tokens(pos, idx))
    assert torch.equal(kept.positions.long(), pos.gather(2, idx))
    assert torch.equal(kept.dequantize()[0][0, 1], k[0, 1, 1::2].half().float())  # as stored: fp16
    assert torch.equal(kept.dequantize()[1][0, 0], v[0, 0, 0::2].half().float())


def test_index_batch_and_tensors():
    k, v = rand(3, 2, 70, 16, seed=5), rand(3, 2, 70, 16, seed=6)
    pos = torch.arange(70).expand(3, 2, 70)
    layer = PackedKV.from_dense(k, v, LayerConfig(0.5, 4, 8), 32, pos)
    picked = layer.index_batch(torch.tensor([2, 0]))
    full_k, full_v = layer.dequantize()
    got_k, got_v = picked.dequantize()
    assert torch.equal(got_k, full_k[[2, 0]]) and torch.equal(got_v, full_v[[2, 0]])
    assert picked.nbytes() * 3 == layer.nbytes() * 2  # every stored tensor is batch-first
    assert layer.nbytes() == sum(t.numel() * t.element_size() for t in layer.tensors())
    assert len(layer.tensors()) == 3 + 3 + 2 + 1  # K codes/scale/zero, V codes/scale/zero, residuals, positions


def test_map_reaches_every_stored_tensor():
    # A raw (16-bit) K side, packed V codes, residuals and positions: map must reach each, in tensors()' order.
    pos = torch.arange(70).expand(2, 2, 70)
    layer = PackedKV.from_dense(rand(2, 2, 70, 16), rand(2, 2, 70, 16, seed=1), LayerConfig(0.5, 16, 8), 32, pos)
    doubled = layer.map(lambda t: torch.cat([t, t], dim=0))
    assert [t.shape[0] for t in doubled.tensors()] == [4] * len(layer.tensors()) == [4] * 7
    assert all(torch.equal(a, torch.cat([b, b])) for a, b in zip(doubled.tensors(), layer.tensors()))
    assert doubled.residuals() == (doubled.k_res, doubled.v_res) and doubled.blocks()[0] is doubled.k_packed


@pytest.mark.parametrize("config", CONFIGS)
def test_growing_tensors_leave_out_only_a_v_residual_that_stays_empty(config):
    """tensors(growing=True) is what a compiled decode step marks dynamic: everything but the V residual of a V
    packed on arrival, which stays empty through appends and flushes."""
    pos = torch.arange(40).expand(1, 2, 40) if config.evicts else None
    layer = PackedKV.from_dense(rand(1, 2, 40, 16), rand(1, 2, 40, 16, seed=1), config, 32, pos)
    for step in range(30):  # through a flush at 64 tokens
        new = torch.tensor([[[40 + step]]], dtype=torch.int16).expand(1, 2, 1) if config.evicts else None
        layer = layer.append(rand(1, 2, 1, 16, seed=10 + step), rand(1, 2, 1, 16, seed=50 + step), new)
        left_out = [t for t in layer.tensors() if all(t is not g for g in layer.tensors(growing=True))]
        assert [id(t) for t in left_out] == ([id(layer.v_res)] if config.v_bits < 16 else [])
        assert all(t.shape[2] == 0 for t in left_out)


def test_bad_inputs():
    k = rand(1, 2, 8, 16)
    with pytest.raises(MoendError, match="positions"):
        PackedKV.from_dense(k, k, LayerConfig(0.5, 4, 4))
    with pytest.raises(MoendError, match=r"\[B, H, n, D\]"):
        PackedKV.from_dense(k, k[..., :8], LayerConfig(1.0, 4, 4))
    with pytest.raises(MoendError, match="positions must be"):
        PackedKV.from_dense(k, k, LayerConfig(0.5, 4, 4), positions=torch.arange(3).expand(1, 2, 3))


def test_padding_never_enters_a_k_groups_min_max():
    """Left padding (and fillers) in a K group: the real tokens are quantized as if the pads were not there."""
    from moend_fx.storage.tokens import fill_pads

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 80, 16, generator=g), torch.randn(2, 2, 80, 16, generator=g)
    valid = torch.ones(2, 2, 80, dtype=torch.bool)
    valid[0, :, :40] = False  # row 0: 40 pads (one whole group, then 8 in the second)
    k[0, :, :40] = 100.0  # pads with huge values: they would own the min/max of their groups
    cfg = LayerConfig(1.0, 4, 4)
    packed = PackedKV.from_dense(k, v, cfg, 32, valid=valid)
    got, _ = packed.dequantize()
    # the second group of row 0 holds 24 real tokens: quantized as a group of those 24 (plus copies of one)
    real = k[0:1, :, 40:64].clone()
    alone = PackedKV.from_dense(torch.cat([real[:, :, :1].expand(1, 2, 8, 16), real], 2), v[0:1, :, 32:64], cfg, 32)
    ref, _ = alone.dequantize()
    assert torch.equal(got[0:1, :, 40:64], ref[:, :, 8:])
    assert (got[0, :, 40:] - k[0, :, 40:]).abs().max() < 0.5  # within 4-bit steps of real ranges, not of 100
    assert torch.equal(fill_pads(k, torch.ones_like(valid), 32), k)  # nothing to fill


@pytest.mark.parametrize("config", [LayerConfig(1.0, 16, 16), LayerConfig(1.0, 4, 8), LayerConfig(1.0, 16, 4),
                                    LayerConfig(1.0, 4, 16), LayerConfig(0.5, 2, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_no_stored_tensor_is_a_view(config, dtype):
    """Every tensor a layer stores owns its storage, whatever the caller passed (here views: slices of a
    transposed tensor) and after every operation: once a compiled step's batch axis is symbolic, dynamo guards
    a view's base, so a tensor that is a view in one step and fresh in the next recompiles (the batch-4
    recompile of ``moend bench decode``; tests/compile/test_compile_generate.py)."""
    def viewed(n, seed):  # [B, H, n, D] as a view of a [B, n, H, D] tensor, as attention modules hand them over
        return rand(2, n, 3, 16, seed=seed).to(dtype).transpose(1, 2)

    k, v = viewed(70, 1), viewed(70, 2)
    pos = torch.arange(70).expand(2, 3, 70)
    layer = PackedKV.from_dense(k, v, config, 32, positions=pos if config.evicts else None)
    states = [layer]
    for step in range(40):  # crosses a group boundary: flushes
        extra = {"positions": torch.full((2, 3, 1), 70 + step)} if config.evicts else {}
        layer = layer.append(viewed(1, 10 + step), viewed(1, 60 + step), keep_full=step % 2 == 0, **extra)
        states.append(layer)
    states.append(layer.flush())
    if layer.num_groups:
        groups = torch.arange(layer.num_groups - 1, -1, -2).flip(0).expand(2, 3, -1).contiguous()
        states.append(layer.keep_groups(groups))
    for s in states:
        assert all(t._base is None for t in s.tensors()), [tuple(t.shape) for t in s.tensors() if t._base is not None]
