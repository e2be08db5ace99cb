"""What a plan or a sensitivity table must match to be applied to a model: its attention shapes."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from moend_fx.common.checks import check_int
from moend_fx.common.errors import PlanError

_COMPARED = ("architecture", "num_layers", "num_kv_heads", "head_dim", "num_heads")


def sliding_layers(cfg: Any) -> list[int]:
    """Indices of the layers of a Hugging Face text config that attend through a sliding window: those whose
    ``layer_types`` entry is not ``"full_attention"`` (Gemma 3, Qwen2 with ``use_sliding_window``), or every layer
    of a config with a ``sliding_window`` and no ``layer_types`` (Mistral)."""
    n = int(cfg.num_hidden_layers)
    types = getattr(cfg, "layer_types", None)
    if types:
        return [i for i, t in enumerate(types) if t != "full_attention"]
    return list(range(n)) if getattr(cfg, "sliding_window", None) is not None else []


def check_full_attention(cfg: Any) -> None:
    """A PlanError when any layer attends through a sliding window: a plan routes full-attention layers, and a
    sliding layer's cache (its window, whatever the plan) is not what the memory model counts."""
    sliding = sliding_layers(cfg)
    if sliding:
        shown = ", ".join(map(str, sliding[:8])) + (", ..." if len(sliding) > 8 else "")
        raise PlanError(
            f"this model has {len(sliding)} sliding-window attention layer(s) of {cfg.num_hidden_layers} (layers "
            f"{shown}; window {getattr(cfg, 'sliding_window', None)}); moend_fx routes models whose every layer "
            "is full attention (Llama, Qwen2 without use_sliding_window, ...): see docs/models.md"
        )


@dataclass(frozen=True)
class ModelFingerprint:
    """What a plan or table must match to be applied to a model."""

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int
    dtype: str = "float32"

    @classmethod
    def from_model(cls, model: Any) -> ModelFingerprint:
        cfg = model.config
        cfg = getattr(cfg, "text_config", None) or cfg
        check_full_attention(cfg)
        heads = int(cfg.num_attention_heads)
        kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        arch = (getattr(cfg, "architectures", None) or [type(model).__name__])[0]
        dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        return cls(arch, int(cfg.num_hidden_layers), kv, head_dim, heads, dtype)

    def mismatch(self, other: ModelFingerprint, what: str = "plan") -> str | None:
        """A sentence naming the first field that differs, or None (dtype may differ)."""
        for f in _COMPARED:
            a, b = getattr(self, f), getattr(other, f)
            if a != b:
                return f"the {what} was made for a model with {f}={a!r}, but this model has {f}={b!r}"
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> ModelFingerprint:
        if not isinstance(d, dict):
            raise PlanError(f"model fingerprint must be an object; got {d!r}")
        if not isinstance(d.get("architecture"), str):
            raise PlanError(f"model.architecture={d.get('architecture')!r} is invalid; expected a str")
        for k in _COMPARED[1:]:
            check_int(f"model.{k}", d.get(k), error=PlanError)
        return cls(**{k: d[k] for k in _COMPARED}, dtype=str(d.get("dtype", "float32")))
