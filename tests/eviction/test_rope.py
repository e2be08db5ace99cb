"""RoPE helpers: HF parity, exact inverse, complex pairing, streaming pre-RoPE query statistics."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.common.errors import MoendError
from moend_fx.eviction.query_stats import QueryStats
from moend_fx.eviction.rope import RopeSpec, apply_rope, invert_rope, rope_from_model, to_complex

FAST = settings(max_examples=25, deadline=None)


def _randn(seed: int, *shape: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _tiny_model(family: str, head_dim: int = 16):
    import transformers as tf

    cfgs = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }
    cfg_cls, model_cls = cfgs[family]
    cfg = cfg_cls(
        vocab_size=64,
        hidden_size=4 * head_dim,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return model_cls(cfg).eval()


@FAST
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    t=st.integers(1, 9),
    half=st.integers(1, 16),
    scaling=st.sampled_from([1.0, 0.7, 1.3]),
    max_pos=st.sampled_from([16, 5000, 130000]),
)
def test_apply_invert_round_trip(seed, b, h, t, half, scaling, max_pos):
    spec = RopeSpec(tuple(RopeSpec.default(2 * half).inv_freq), attention_scaling=scaling)
    x = _randn(seed, b, h, t, 2 * half)
    pos = torch.randint(0, max_pos, (b, t), generator=torch.Generator().manual_seed(seed))
    back = invert_rope(apply_rope(x, pos, spec), pos, spec)
    # float32: each rotation is orthogonal up to cos^2 + sin^2 = 1 +- 1 ulp, so a few ulps of |x|
    assert torch.allclose(back, x, rtol=1e-5, atol=1e-5)
    # rotation keeps the norm of every pair (times the scaling)
    rot = apply_rope(x, pos, spec)
    assert torch.allclose(to_complex(rot).abs(), to_complex(x).abs() * scaling, rtol=1e-5, atol=1e-5)


def test_positions_shapes_broadcast():
    spec = RopeSpec.default(8)
    x = _randn(1, 2, 3, 5, 8)
    pos1 = torch.arange(5) * 3
    a = apply_rope(x, pos1, spec)
    b = apply_rope(x, pos1[None].expand(2, 5), spec)
    c = apply_rope(x, pos1[None, None].expand(2, 3, 5), spec)
    assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_matches_hf_rotary(family):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = _tiny_model(family)
    spec = rope_from_model(model)
    assert spec.head_dim == 16
    q, k = _randn(3, 2, 4, 7, 16), _randn(4, 2, 2, 7, 16)
    pos = torch.tensor([[0, 1, 2, 5, 9, 40, 200], [3, 4, 8, 16, 17, 90, 91]])
    cos, sin = model.model.rotary_emb(q, pos)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    # same float32 angles and the same op order as HF: bit-identical
    assert torch.equal(apply_rope(q, pos, spec), q_hf)
    assert torch.equal(apply_rope(k, pos, spec), k_hf)


def test_rope_from_model_rejects_non_rope():
    with pytest.raises(MoendError, match="rotary"):
        rope_from_model(torch.nn.Linear(2, 2))


def test_rope_spec_validation():
    with pytest.raises(MoendError, match="empty"):
        RopeSpec(())
    with pytest.raises(MoendError, match="attention_scaling"):
        RopeSpec((1.0,), attention_scaling=0.0)
    with pytest.raises(MoendError, match="layout"):
        RopeSpec((1.0,), layout="rotate_quarter")
    with pytest.raises(MoendError, match="pass-through"):
        RopeSpec((1.0,), pass_dims=3)
    with pytest.raises(MoendError, match="head_dim"):
        RopeSpec.default(7)
    spec = RopeSpec(torch.tensor([1.0, 0.5]))
    assert spec.inv_freq == (1.0, 0.5) and spec == RopeSpec((1.0, 0.5))
    x = _randn(0, 1, 1, 3, 4)
    with pytest.raises(MoendError, match="head_dim"):
        apply_rope(_randn(0, 1, 1, 3, 6), torch.arange(3), spec)
    with pytest.raises(MoendError, match="positions"):
        apply_rope(x, torch.arange(4), spec)
    with pytest.raises(MoendError, match="integer"):
        apply_rope(x, torch.arange(3).float(), spec)


@FAST
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(0, 3000), p=st.integers(0, 3000), half=st.integers(1, 12))
def test_dot_product_is_trig_series(seed, t, p, half):
    """q_rot(t) . k_rot(p) = sum_f |q_f||k_f| cos(w_f (t - p) + arg q_f - arg k_f): what `trig` relies on."""
    spec = RopeSpec.default(2 * half)
    q, k = (
        _randn(seed, 1, 1, 1, 2 * half, dtype=torch.float64),
        _randn(seed + 1, 1, 1, 1, 2 * half, dtype=torch.float64),
    )
    dot = (apply_rope(q, torch.tensor([t]), spec) * apply_rope(k, torch.tensor([p]), spec)).sum()
    qc, kc = to_complex(q).flatten(), to_complex(k).flatten()
    w = torch.tensor(spec.inv_freq, dtype=torch.float64)
    series = (qc.abs() * kc.abs() * torch.cos(w * (t - p) + qc.angle() - kc.angle())).sum()
    # float32 angles inside apply_rope (as HF): phase error ~ 3000 * 6e-8 rad per pair
    assert torch.allclose(dot, series, rtol=1e-3, atol=1e-3 * (qc.abs() * kc.abs()).sum().item())


def test_to_complex_pairs_halves():
    x = torch.arange(8.0)
    z = to_complex(x)
    assert torch.equal(z.real, torch.tensor([0.0, 1, 2, 3])) and torch.equal(z.imag, torch.tensor([4.0, 5, 6, 7]))
    with pytest.raises(MoendError):
        to_complex(torch.ones(3))


def test_query_stats_streaming_equals_one_shot():
    q = _randn(5, 3, 4, 11, 8)
    one = QueryStats.empty(4, 8).accumulate(q)
    parts = QueryStats.empty(4, 8).accumulate(q[:1]).accumulate(q[1:, :, :6])
    parts = parts.merge(QueryStats.empty(4, 8).accumulate(q[1:, :, 6:]))
    assert one.count == parts.count == 33
    z = to_complex(q.double())
    # float64 sums of the same numbers in another order
    assert torch.allclose(one.mean, z.mean(dim=(0, 2)), atol=1e-12)
    assert torch.allclose(parts.mean, one.mean, atol=1e-12)
    assert torch.allclose(parts.abs_mean, z.abs().mean(dim=(0, 2)), atol=1e-12)
    back = QueryStats.from_tensors(one.to_tensors(prefix="layers.3."), prefix="layers.3.")
    assert torch.equal(back.sum, one.sum) and torch.equal(back.abs_sum, one.abs_sum) and back.count == one.count
    np_back = QueryStats.from_tensors({k: v.numpy() for k, v in one.to_tensors().items()})
    assert np_back.count == one.count


def test_query_stats_mask_and_rotated():
    spec = RopeSpec.default(8, theta=500.0)
    q = _randn(6, 2, 3, 5, 8, dtype=torch.float64)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 9, 11, 13, 15]])
    mask = torch.tensor([[True, True, False, True, True], [False, True, True, True, True]])
    direct = QueryStats.empty(3, 8).accumulate(q, mask)
    rotated = QueryStats.empty(3, 8).accumulate_rotated(apply_rope(q, pos, spec), pos, spec, mask)
    assert direct.count == rotated.count == 8
    keep = to_complex(q).permute(0, 2, 1, 3)[mask]  # [8, H, F]
    assert torch.allclose(direct.mean, keep.mean(0), atol=1e-12)
    # float64 rotation there and back
    assert torch.allclose(rotated.mean, direct.mean, atol=1e-10)
    assert torch.allclose(rotated.abs_mean, direct.abs_mean, atol=1e-10)


def test_query_stats_errors():
    s = QueryStats.empty(2, 4)
    with pytest.raises(MoendError, match="empty"):
        _ = s.mean
    with pytest.raises(MoendError, match="q_pre"):
        s.accumulate(torch.ones(1, 3, 2, 4))
    with pytest.raises(MoendError, match="merge"):
        s.merge(QueryStats.empty(3, 4))
    with pytest.raises(MoendError, match="mask"):
        s.accumulate(torch.ones(1, 2, 2, 4), torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(MoendError, match="missing"):
        QueryStats.from_tensors({"sum": torch.zeros(2, 2, 2)})
    with pytest.raises(MoendError):
        QueryStats.empty(2, 5)
