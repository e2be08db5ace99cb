"""Tiny random-weight decoder models built from transformers' own config classes, for fast unit tests.

:data:`TINY_CONFIGS` is the family matrix (``tests/models/test_families.py``): one row per family, the
``model_type`` of its config and the config fields that make it that family in miniature (experts of a mixture,
partial rotary, ...). Adding a family is one row.
"""

from __future__ import annotations

from typing import Any

import torch

from moend_fx.common.checks import check_int
from moend_fx.common.errors import MoendError
from moend_fx.models.loader import check_dtype

_PARTIAL = {"rope_type": "default", "rope_theta": 10000.0}
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "mistral": ("mistral", {"sliding_window": None}),  # full attention, like the other families: masks stay simple
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "qwen3": ("qwen3", {}),  # QK-norm
    "qwen3_moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "gemma": ("gemma", {}),
    "phi3": ("phi3", {}),
    "phi3-partial": ("phi3", {"rope_parameters": {**_PARTIAL, "partial_rotary_factor": 0.5}}),  # Phi-4-mini's kind
    "phi": ("phi", {"rope_parameters": {**_PARTIAL, "partial_rotary_factor": 0.5}}),  # Phi-2: partial rotary
    "stablelm": ("stablelm", {"rope_parameters": {**_PARTIAL, "partial_rotary_factor": 0.25}}),
    # GPT-NeoX (Pythia): partial rotary, its rotary module at gpt_neox.rotary_emb, no GQA
    "gpt_neox": ("gpt_neox", {"rope_parameters": {**_PARTIAL, "partial_rotary_factor": 0.25}}),
    "olmo2": ("olmo2", {}),  # QK-norm over all heads
    "granite": ("granite", {"attention_multiplier": 0.2, "residual_multiplier": 0.5, "logits_scaling": 2.0}),
    "starcoder2": ("starcoder2", {"sliding_window": None}),
    "cohere": ("cohere", {}),  # interleaved RoPE pairs, parallel attention and MLP
    "smollm3": ("smollm3", {}),
    # sliding-window layers (moend_fx.cache.sliding), windows far shorter than the matrix's 600-token prompt
    "mistral-sliding": ("mistral", {"sliding_window": 64}),  # Mistral-7B-v0.1's kind: every layer slides
    "qwen2-sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}),
    # the matrix's two layers; layer 0 full, so the RoPE check reads the global base the scorers use
    "gemma3_text": ("gemma3_text", {"sliding_window": 64, "layer_types": ["full_attention", "sliding_attention"]}),
}
"""family name -> (config ``model_type``, config fields). Families whose attention has no GQA (GPT-NeoX) take
``num_kv_heads == num_heads``."""
MHA_ONLY = ("gpt_neox",)
TINY_FAMILIES = ("llama", "qwen2", "mistral")
"""The families the presets span, which take any shape (a hidden size other than heads x head_dim included)."""

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


def _build(family: str, fields: dict[str, Any]) -> Any:
    """The family's config from ``fields`` and a random-weight causal LM of it (transformers' own classes)."""
    from transformers import CONFIG_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING

    model_type, extra = TINY_CONFIGS[family]
    config = CONFIG_MAPPING[model_type](**{**fields, **extra})
    # a config without a head_dim field sizes heads as hidden_size / num_heads (the preset families read head_dim)
    native = family in TINY_FAMILIES or "head_dim" in getattr(type(config), "__dataclass_fields__", {})
    if not native and fields["hidden_size"] != fields["num_attention_heads"] * fields["head_dim"]:
        raise MoendError(f"family {family!r} sizes its heads as hidden_size / num_heads: hidden_size="
                         f"{fields['hidden_size']} must be num_heads * head_dim = "
                         f"{fields['num_attention_heads'] * fields['head_dim']}")
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):  # defaults beyond a tiny vocabulary
        tid = getattr(config, name, None)
        if isinstance(tid, int) and tid >= fields["vocab_size"]:
            setattr(config, name, None)
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    config.architectures = [cls.__name__]
    return config, cls


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
    """A random-weight causal LM of ``family`` (a key of :data:`TINY_CONFIGS`) built from a config in code, in
    eval mode.

    The same arguments and ``seed`` give the same weights; the global torch RNG is left untouched.
    ``hidden_size`` defaults to ``num_heads * head_dim``.
    """
    if not isinstance(family, str) or family.lower() not in TINY_CONFIGS:
        raise MoendError(f"unknown tiny model family {family!r}; allowed: {', '.join(TINY_CONFIGS)}")
    family = family.lower()
    if family in MHA_ONLY and num_kv_heads != num_heads:
        raise MoendError(f"family {family!r} has no grouped-query attention: num_kv_heads={num_kv_heads} must equal "
                         f"num_heads={num_heads}")
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
    config, cls = _build(family, kw)
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model.to(dtype).eval()


def tiny_preset(name: str, **overrides: Any) -> Any:
    """:func:`tiny_model` from a named entry of :data:`TINY_PRESETS`, with optional overrides (e.g. seed)."""
    if name not in TINY_PRESETS:
        raise MoendError(f"unknown tiny preset {name!r}; allowed: {', '.join(TINY_PRESETS)}")
    return tiny_model(**{**TINY_PRESETS[name], **overrides})
