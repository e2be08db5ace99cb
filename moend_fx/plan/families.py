"""The Hugging Face decoder families moend_fx serves, and one clear refusal for a model it cannot serve.

A plan, a table and a cache apply to any decoder whose attention is softmax over the keys a ``Cache`` holds, with
RoPE (or no position code in the keys at all); what differs between families is data in :data:`FAMILIES`: how the
rotated channels pair (``rope_layout``) and whether the attention module hands its keyword arguments to
``cache.update`` (``update_kwargs``; GPT-NeoX does not, so ``prepare`` hands the cache layer over itself). A model
that needs what the moend attention and its kernels do not compute (learned sinks, ALiBi, ...)
is refused by :func:`check_family` with one :class:`PlanError` naming the family and the reason, before anything
deeper could fail on a shape. ``docs/models.md`` has the support table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moend_fx.common.errors import PlanError


@dataclass(frozen=True)
class Family:
    """One row: ``model_type`` (the config's), the pairing of its rotated channels (``"rotate_half"`` or
    ``"interleaved"``), whether its attention passes its kwargs to ``cache.update``, and why it is refused
    (None: served)."""

    model_type: str
    rope_layout: str = "rotate_half"
    update_kwargs: bool = True
    refused: str | None = None


_ROWS = (
    Family("llama"), Family("mistral"), Family("mixtral"), Family("qwen2"), Family("qwen3"), Family("qwen3_moe"),
    Family("gemma"), Family("gemma3_text"), Family("phi3"), Family("phi"), Family("stablelm"),
    Family("gpt_neox", update_kwargs=False), Family("olmo2"), Family("granite"), Family("starcoder2"),
    Family("cohere", rope_layout="interleaved"), Family("smollm3"),
    Family("gpt_oss", refused="its learned attention sinks (a per-head logit with no value in every softmax) are "
                              "not computed by the moend attention or its fused kernels"),
    Family("bloom", refused="ALiBi position biases are not applied by the moend attention"),
    Family("mpt", refused="ALiBi position biases are not applied by the moend attention"),
    Family("deepseek_v2", refused="multi-head latent attention (keys and values of other sizes than the heads)"),
    Family("deepseek_v3", refused="multi-head latent attention (keys and values of other sizes than the heads)"),
)
FAMILIES: dict[str, Family] = {row.model_type: row for row in _ROWS}
"""Known families by ``model_type``. A family not listed is served if no structural check refuses it."""


def text_config(model_or_config: Any) -> Any:
    """The text config of a model or config (a multimodal config's ``text_config``)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    return getattr(cfg, "text_config", None) or cfg


def family_of(model_or_config: Any) -> Family | None:
    """The :data:`FAMILIES` row of a model or config, or None for a family not listed."""
    return FAMILIES.get(str(getattr(text_config(model_or_config), "model_type", "")))


def _alibi(cfg: Any) -> str | None:
    if getattr(cfg, "alibi", False) or getattr(cfg, "position_embedding_type", None) == "alibi":
        return "ALiBi position biases are not applied by the moend attention"
    return None


def _linear_layers(cfg: Any) -> str | None:
    kinds = sorted({t for t in (getattr(cfg, "layer_types", None) or ()) if "attention" not in t or "linear" in t})
    if kinds:
        return f"layers of kind {kinds} keep recurrent state, not a key/value cache"
    return None


def _partial_rotary(cfg: Any) -> str | None:
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    if not heads:
        return None
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    params = getattr(cfg, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", 1.0) if isinstance(params, dict) else 1.0
    rotary = int(head_dim * float(factor or 1.0))
    if rotary % 2 or (head_dim - rotary) % 2:
        return (f"partial rotary embedding over {rotary} of {head_dim} channels: both the rotated and the passed "
                "channels must be even in number")
    return None


CHECKS: tuple[Callable[[Any], str | None], ...] = (_alibi, _linear_layers, _partial_rotary)
"""Structural checks every model goes through, listed or not: each returns why it is refused, or None."""


def refusal(model_or_config: Any) -> str | None:
    """Why moend_fx cannot serve this model (one sentence), or None."""
    row = family_of(model_or_config)
    if row is not None and row.refused:
        return row.refused
    cfg = text_config(model_or_config)
    return next((why for why in (check(cfg) for check in CHECKS) if why), None)


def check_family(model_or_config: Any) -> None:
    """A :class:`PlanError` naming the family and the reason when moend_fx cannot serve the model."""
    why = refusal(model_or_config)
    if why:
        cfg = text_config(model_or_config)
        arch = (getattr(cfg, "architectures", None) or [type(model_or_config).__name__])[0]
        raise PlanError(f"moend_fx cannot serve {getattr(cfg, 'model_type', None) or arch!r} models ({arch}): "
                        f"{why}; docs/models.md lists the supported families")
