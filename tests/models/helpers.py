"""A tiny model saved as a local Hugging Face folder (weights + a word-level tokenizer), for tests that load a
model by path as a user would."""

from __future__ import annotations

from pathlib import Path

import torch

from moend_fx.models import tiny_preset

WORDS = 256
"""The tokenizer's vocabulary: ``[UNK]`` (id 0) and the words ``w1`` .. ``w255`` (id = the number)."""


def save_tiny_folder(path: Path, preset: str = "llama-gqa-hd16") -> torch.nn.Module:
    """Save ``tiny_preset(preset)`` and a whitespace word-level tokenizer into ``path``; return the model.

    Llama presets, not Qwen2: transformers 5's AutoTokenizer swaps a generic tokenizer for Qwen2Tokenizer when
    the config says qwen2, which would not read this word-level vocabulary."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    model = tiny_preset(preset)
    model.save_pretrained(str(path))
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, WORDS)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(path))
    return model
