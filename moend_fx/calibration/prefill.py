"""What a captured prefill leaves in a layer: the tokens the cache keeps after it, and the model body that
capture runs (calibration's window errors and the continuation KL both start from these)."""

from __future__ import annotations

from typing import Any

import torch

from moend_fx.calibration.capture import LayerCapture
from moend_fx.eviction.selection import select_tokens
from moend_fx.plan.memory import keep_count
from moend_fx.storage.tokens import gather_tokens

__all__ = ["kept_tokens", "model_body"]


def model_body(model: Any) -> Any:
    """The transformer without its LM head (``model.base_model``), else the model itself."""
    body = getattr(model, "base_model", None)
    return body if body is not None and body is not model else model


def kept_tokens(cap: LayerCapture, scores: torch.Tensor | None, keep: float, sink: int, recent: int,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Kept K, V [B, Hkv, n, D] and positions [B, Hkv, n] (None when nothing is evicted): as many tokens as the
    cache keeps, its sinks and recent window at least. scores: [B, Hkv, T] (None only when nothing is evicted)."""
    b, hkv, t, _ = cap.keys.shape
    n = keep_count(t, keep, floor=sink + recent)
    if n >= t:
        return cap.keys, cap.values, None
    kp = cap.key_positions[:, None, :].expand(b, hkv, t)
    idx, pos = select_tokens(scores, n, sink_tokens=sink, recent_tokens=recent, key_positions=kp)
    return gather_tokens(cap.keys, idx), gather_tokens(cap.values, idx), pos
