"""Tiny random-weight Llama / Qwen2 / Mistral models built from a config in code, for fast unit tests."""

from __future__ import annotations

from typing import Any

import torch

from moend_fx.common.checks import check_int
from moend_fx.common.errors import MoendError
from moend_fx.models.loader import check_dtype

TINY_FAMILIES = ("llama", "qwen2", "mistral")

# Small enough that a forward over 256 tokens takes milliseconds on a CPU; together they cover GQA and MHA,
# 2-4 layers and head_dim 16-64 across the three families.
TINY_PRESETS: dict[str, dict[str, Any]] = {
    "llama-gqa-hd16": dict(family="llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16),
    "llama-mha-hd32": dict(family="llama", num_layers=3, num_heads=4, num_kv_heads=4, head_dim=32),
    # SmolLM2's shape in miniature: groups of 3 query heads per KV head, head_dim 64, and a hidden size
    # that is not num_heads * head_dim.
    "llama-gqa3-hd64": dict(family="llama", num_layers=3, num_heads=6, num_kv_heads=2, head_dim=64,
                            hidden_size=192),
    "qwen2-gqa-hd16": dict(family="qwen2", num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16),
    "qwen2-mha-hd32": dict(family="qwen2", num_layers=3, num_heads=2, num_kv_heads=2, head_dim=32),
    "mistral-gqa-hd64": dict(family="mistral", num_layers=2, num_heads=4, num_kv_heads=1, head_dim=64),
    "mistral-mha-hd16": dict(family="mistral", num_layers=4, num_heads=4, num_kv_heads=4, head_dim=16),
}


def _config_class(family: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    return {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[family]


def _model_class(family: str):
    from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

    return {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "mistral": MistralForCausalLM}[family]


def tiny_model(
    family: str = "llama",
    *,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    hidden_size: int | None = None,
    vocab_size: int = 256,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> Any:
    """A random-weight ``{Llama,Qwen2,Mistral}ForCausalLM`` built from a config in code, in eval mode.

    The same arguments and ``seed`` give the same weights; the global torch RNG is left untouched.
    ``hidden_size`` defaults to ``num_heads * head_dim``.
    """
    if not isinstance(family, str) or family.lower() not in TINY_FAMILIES:
        raise MoendError(f"unknown tiny model family {family!r}; allowed: {', '.join(TINY_FAMILIES)}")
    family = family.lower()
    for n, v in (("num_layers", num_layers), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                 ("head_dim", head_dim), ("vocab_size", vocab_size),
                 ("max_position_embeddings", max_position_embeddings)):
        check_int(n, v)
    if num_heads % num_kv_heads:
        raise MoendError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads} "
                         "(each KV head serves a whole group of query heads)")
    if head_dim % 2:
        raise MoendError(f"head_dim={head_dim} must be even (RoPE rotates pairs of channels)")
    hidden = check_int("hidden_size", hidden_size) if hidden_size is not None else num_heads * head_dim
    dtype = check_dtype(dtype)
    kw: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
    )
    if family == "mistral":
        kw["sliding_window"] = None  # full attention, like the other families: masks stay simple
    config = _config_class(family)(**kw)
    config.architectures = [_model_class(family).__name__]
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _model_class(family)(config)
    return model.to(dtype).eval()


def tiny_preset(name: str, **overrides: Any) -> Any:
    """:func:`tiny_model` from a named entry of :data:`TINY_PRESETS`, with optional overrides (e.g. seed)."""
    if name not in TINY_PRESETS:
        raise MoendError(f"unknown tiny preset {name!r}; allowed: {', '.join(TINY_PRESETS)}")
    return tiny_model(**{**TINY_PRESETS[name], **overrides})
