"""A fingerprint records which layers attend through a sliding window (Gemma 2 / 3, Mistral with ``sliding_window``,
Qwen2 with ``use_sliding_window``) and the window, so a plan prices them by it; plans of full-attention models
read and write exactly as before (no sliding fields in their JSON)."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

from moend_fx.common.errors import PlanError
from moend_fx.models import tiny_model
from moend_fx.plan.fingerprint import ModelFingerprint, sliding_layers

SMALL = dict(num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, vocab_size=256)


def _model(cfg):
    return types.SimpleNamespace(config=cfg, parameters=lambda: iter([torch.zeros(1)]))


def test_gemma3_pattern_records_its_five_sliding_layers_of_six_and_the_window():
    cfg = Gemma3TextConfig(**SMALL, sliding_window=512)
    assert sliding_layers(cfg) == [0, 1, 2, 3, 4]
    fp = ModelFingerprint.from_model(_model(cfg))
    assert fp.sliding == (0, 1, 2, 3, 4) and fp.sliding_window == 512
    assert [fp.layer_tokens(i, 4096) for i in (0, 5)] == [511, 4096]  # HF keeps window - 1 between steps
    assert fp.layer_tokens(0, 100) == 100
    assert ModelFingerprint.from_dict(fp.to_dict()) == fp
    assert fp.to_dict()["sliding"] == [0, 1, 2, 3, 4]


def test_a_wrapped_text_config_is_read_too():
    outer = types.SimpleNamespace(text_config=Gemma3TextConfig(**SMALL, sliding_window=64))
    assert ModelFingerprint.from_model(_model(outer)).sliding_window == 64


@pytest.mark.parametrize("cfg,sliding", [
    (MistralConfig(**SMALL, sliding_window=4096), list(range(6))),  # no layer_types: every layer slides
    (MistralConfig(**SMALL, sliding_window=None), []),
    (Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=256, max_window_layers=4), [4, 5]),
    (Qwen2Config(**SMALL), []),  # the shipped Qwen2.5: sliding_window is dropped when not used
    (Gemma2Config(**SMALL, sliding_window=128), [0, 2, 4]),
    (LlamaConfig(**SMALL), []),
])
def test_sliding_layers_per_config_family(cfg, sliding):
    assert sliding_layers(cfg) == sliding
    assert list(ModelFingerprint.from_model(_model(cfg)).sliding) == sliding


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_full_attention_models_fingerprint_as_before(family):
    fp = ModelFingerprint.from_model(tiny_model(family, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16))
    assert fp.num_layers == 2 and fp.num_kv_heads == 2 and fp.sliding == () and fp.sliding_window == 0
    assert "sliding" not in fp.to_dict() and "sliding_window" not in fp.to_dict()


def test_a_plan_for_another_window_is_refused_by_name():
    a = ModelFingerprint("Gemma3ForCausalLM", 6, 1, 32, 4, sliding=(0, 1), sliding_window=512)
    b = ModelFingerprint("Gemma3ForCausalLM", 6, 1, 32, 4, sliding=(0, 1), sliding_window=1024)
    assert "sliding_window=512" in a.mismatch(b)
    assert "sliding=()" in ModelFingerprint("Gemma3ForCausalLM", 6, 1, 32, 4).mismatch(a)


@pytest.mark.parametrize("bad", [dict(sliding=[0, 9], sliding_window=16), dict(sliding=[0], sliding_window=1),
                                 dict(sliding="0,1", sliding_window=16)])
def test_bad_sliding_fields_are_refused(bad):
    d = {**ModelFingerprint("Gemma3ForCausalLM", 6, 1, 32, 4).to_dict(), **bad}
    with pytest.raises(PlanError, match="sliding"):
        ModelFingerprint.from_dict(d)
