"""What a plan or a sensitivity table must match to be applied to a model: its attention shapes, and which of its
layers attend through a sliding window (Gemma 2 / 3, Mistral with ``sliding_window``, Qwen2 with
``use_sliding_window``): such a layer never holds more than its window, so the memory model prices it by it."""

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


def sliding_window_of(cfg: Any) -> int:
    """The sliding window (tokens) of a config with sliding layers, else 0."""
    return int(getattr(cfg, "sliding_window", None) or 0) if sliding_layers(cfg) else 0


@dataclass(frozen=True)
class ModelFingerprint:
    """What a plan or table must match to be applied to a model.

    sliding: the indices of the layers that attend through a sliding window of ``sliding_window`` tokens (empty
    and 0 for a model whose every layer is full attention; then neither is written to JSON, so the plans and
    tables of such models read and write as before)."""

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int
    dtype: str = "float32"
    sliding: tuple[int, ...] = ()
    sliding_window: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "sliding", tuple(int(i) for i in self.sliding))
        if self.sliding and (self.sliding_window < 2 or not all(0 <= i < self.num_layers for i in self.sliding)):
            raise PlanError(f"sliding layers {list(self.sliding)} with window {self.sliding_window}: expected "
                            f"layer indices in [0, {self.num_layers}) and a window of at least 2 tokens")

    def is_sliding(self, layer: int) -> bool:
        """Whether layer ``layer`` attends through the sliding window."""
        return layer in self.sliding

    def layer_tokens(self, layer: int, tokens: int) -> int:
        """Tokens layer ``layer`` holds between steps after ``tokens`` tokens: all of them for a full-attention
        layer; ``min(tokens, sliding_window - 1)`` for a sliding one (what transformers' own
        ``DynamicSlidingWindowLayer`` keeps: the next query sees itself and the ``window - 1`` before it)."""
        return min(tokens, self.sliding_window - 1) if self.is_sliding(layer) else tokens

    @classmethod
    def from_model(cls, model: Any) -> ModelFingerprint:
        cfg = model.config
        cfg = getattr(cfg, "text_config", None) or cfg
        heads = int(cfg.num_attention_heads)
        kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        arch = (getattr(cfg, "architectures", None) or [type(model).__name__])[0]
        dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        return cls(arch, int(cfg.num_hidden_layers), kv, head_dim, heads, dtype, tuple(sliding_layers(cfg)),
                   sliding_window_of(cfg))

    def mismatch(self, other: ModelFingerprint, what: str = "plan") -> str | None:
        """A sentence naming the first field that differs, or None (dtype may differ)."""
        for f in _COMPARED + ("sliding", "sliding_window"):
            a, b = getattr(self, f), getattr(other, f)
            if a != b:
                return f"the {what} was made for a model with {f}={a!r}, but this model has {f}={b!r}"
        return None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not self.sliding:
            del d["sliding"], d["sliding_window"]
        else:
            d["sliding"] = list(self.sliding)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> ModelFingerprint:
        if not isinstance(d, dict):
            raise PlanError(f"model fingerprint must be an object; got {d!r}")
        if not isinstance(d.get("architecture"), str):
            raise PlanError(f"model.architecture={d.get('architecture')!r} is invalid; expected a str")
        for k in _COMPARED[1:]:
            check_int(f"model.{k}", d.get(k), error=PlanError)
        sliding = d.get("sliding", [])
        if not isinstance(sliding, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in sliding):
            raise PlanError(f"model.sliding={sliding!r} is invalid; expected a list of layer indices")
        window = check_int("model.sliding_window", d.get("sliding_window", 0), minimum=0, error=PlanError) \
            if sliding else 0
        return cls(**{k: d[k] for k in _COMPARED}, dtype=str(d.get("dtype", "float32")), sliding=tuple(sliding),
                   sliding_window=window)
