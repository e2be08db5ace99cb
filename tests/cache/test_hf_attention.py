"""The "moend" attention function: registration, the no-cache fallback, and the mask gathered at kept positions."""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from moend_fx.attention.reference import attention_dense
from moend_fx.cache.hf_attention import ATTN_NAME, moend_attention
from moend_fx.cache.layer import EvictionPolicy, MoENDLayer
from moend_fx.eviction.scorers import get_scorer
from moend_fx.models import tiny_model
from moend_fx.plan.routing import LayerConfig


def test_registered_with_attention_and_mask_interfaces():
    assert AttentionInterface()[ATTN_NAME] is moend_attention
    assert ATTN_NAME in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping


def test_without_a_cache_it_is_plain_sdpa():
    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    ids = torch.randint(3, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, use_cache=False).logits
        model.set_attn_implementation(ATTN_NAME)
        got = model(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=0)  # the very same SDPA call


def test_logical_mask_is_gathered_at_the_kept_positions():
    """After eviction, a mask over logical columns must hit exactly the columns of the kept tokens."""
    torch.manual_seed(0)
    b, hkv, h, t, d = 2, 2, 4, 40, 16
    layer = MoENDLayer(LayerConfig(0.5, 16, 16), layer_idx=0, scorer=get_scorer("keynorm"),
                       policy=EvictionPolicy(recent_tokens=4, sink_tokens=2))
    module = torch.nn.Module()
    module.num_key_value_groups = h // hkv
    k, v, q = torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d), torch.randn(b, h, t, d)
    kwargs = {}
    layer.update(k, v, kwargs=kwargs)
    assert kwargs["moend_layer"] is layer  # how the attention function reaches the layer
    moend_attention(module, q, k, v, None, scaling=d**-0.5, **kwargs)
    # decode one token with a logical mask that hides some logical columns
    k1, v1, q1 = torch.randn(b, hkv, 1, d), torch.randn(b, hkv, 1, d), torch.randn(b, h, 1, d)
    kwargs = {}
    layer.update(k1, v1, kwargs=kwargs)
    lmask = torch.rand(b, 1, 1, t + 1, generator=torch.Generator().manual_seed(1)) > 0.3
    lmask[..., -1] = True
    out, _ = moend_attention(module, q1, k1, v1, lmask, scaling=d**-0.5, **kwargs)
    kk, vv = layer.packed.dequantize()
    pos = layer.packed.positions.long()
    held_mask = lmask[:, 0, 0][torch.arange(b)[:, None, None], pos]  # [B, Hkv, n]
    want = attention_dense(q1, kk, vv, scale=d**-0.5, mask=held_mask[:, :, None].repeat_interleave(2, 1))
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=1e-6, atol=1e-6)  # same maths, same order
