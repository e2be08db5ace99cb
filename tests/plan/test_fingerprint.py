"""A fingerprint is taken only of a model whose every layer is full attention: sliding-window layers (Gemma 3,
Mistral, Qwen2 with ``use_sliding_window``) are refused with an error naming them, before any plan is made."""

from __future__ import annotations

import types

import pytest
from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

from moend_fx.common.errors import PlanError
from moend_fx.models import tiny_model
from moend_fx.plan.fingerprint import ModelFingerprint, sliding_layers

SMALL = dict(num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, vocab_size=256)


def test_gemma3_pattern_names_its_five_sliding_layers_of_six():
    cfg = Gemma3TextConfig(**SMALL, sliding_window=512)
    assert sliding_layers(cfg) == [0, 1, 2, 3, 4]
    with pytest.raises(PlanError, match=r"5 sliding-window attention layer\(s\) of 6 \(layers 0, 1, 2, 3, 4; "):
        ModelFingerprint.from_model(types.SimpleNamespace(config=cfg))


def test_a_wrapped_text_config_is_checked_too():
    outer = types.SimpleNamespace(text_config=Gemma3TextConfig(**SMALL))
    with pytest.raises(PlanError, match="full attention"):
        ModelFingerprint.from_model(types.SimpleNamespace(config=outer))


@pytest.mark.parametrize("cfg,sliding", [
    (MistralConfig(**SMALL, sliding_window=4096), list(range(6))),  # no layer_types: every layer slides
    (MistralConfig(**SMALL, sliding_window=None), []),
    (Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=256, max_window_layers=4), [4, 5]),
    (Qwen2Config(**SMALL), []),  # the shipped Qwen2.5: sliding_window is dropped when not used
    (LlamaConfig(**SMALL), []),
])
def test_sliding_layers_per_config_family(cfg, sliding):
    assert sliding_layers(cfg) == sliding


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_full_attention_models_still_fingerprint(family):
    fp = ModelFingerprint.from_model(tiny_model(family, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16))
    assert fp.num_layers == 2 and fp.num_kv_heads == 2
