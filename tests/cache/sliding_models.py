"""Tiny random-weight sliding-window models from transformers' own config classes (Gemma 3's 5:1 hybrid, Gemma 2's
alternation, Mistral with ``sliding_window`` on every layer, Qwen2 with ``use_sliding_window`` on its top layers),
with a window far shorter than the prompts the tests feed, so the sliding layers drop tokens."""

from __future__ import annotations

from typing import Any

import torch

WINDOW = 24

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
               max_position_embeddings=1024, tie_word_embeddings=False)


def _gemma3() -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM, Gemma3TextConfig(**_COMMON, num_hidden_layers=6, num_key_value_heads=1,
                                                sliding_window=WINDOW, query_pre_attn_scalar=16)


def _gemma2() -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    # attention soft-capping is another helper's part (issue 55, item 4); off here, as SDPA ignores it too
    return Gemma2ForCausalLM, Gemma2Config(**_COMMON, num_hidden_layers=4, num_key_value_heads=2,
                                           sliding_window=WINDOW, attn_logit_softcapping=None)


def _mistral() -> Any:
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM, MistralConfig(**_COMMON, num_hidden_layers=3, num_key_value_heads=2,
                                             sliding_window=WINDOW)


def _qwen2() -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM, Qwen2Config(**_COMMON, num_hidden_layers=4, num_key_value_heads=2,
                                         use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)


BUILDERS = {"gemma3_text": _gemma3, "gemma2": _gemma2, "mistral": _mistral, "qwen2": _qwen2}


def sliding_model(family: str, seed: int = 0) -> Any:
    """The tiny ``family`` model (eval mode, fp32, sdpa; Gemma 2 eager), same weights for the same seed."""
    cls, cfg = BUILDERS[family]()
    cfg.architectures = [cls.__name__]
    cfg._attn_implementation = "eager" if family == "gemma2" else "sdpa"  # Gemma 2 has no SDPA path in HF
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
    return model.eval()
