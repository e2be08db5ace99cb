"""Input checks of :meth:`moend_fx.cache.layer.MoENDLayer.load_prefill` (a prompt whose attention ran elsewhere)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from moend_fx.common.errors import MoendError


class PrefillShape(NamedTuple):
    """The sizes of a checked prompt: B, Hkv, T, D of its keys and W of its queries (0 = no queries)."""

    batch: int
    kv_heads: int
    tokens: int
    head_dim: int
    queries: int


def check_prefill_tensors(where: str, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None, *,
                          needs_queries: bool, scorer: str | None, config: str) -> PrefillShape:
    """The prompt's sizes, or a MoendError naming the problem unless keys, values: [B, Hkv, T, D] (same shape,
    B, T >= 1) and queries: None or [B, H, W, D] with H a multiple of Hkv and 1 <= W <= T. ``needs_queries``: the
    layer's scorer cannot score without them (then None is an error too)."""
    for name, t in (("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise MoendError(f"{where}: {name} must be a 4-D tensor [B, Hkv, T, D]; got {got}")
    if keys.shape != values.shape:
        raise MoendError(f"{where}: keys {tuple(keys.shape)} and values {tuple(values.shape)} must have the "
                         "same shape [B, Hkv, T, D] (same batch, KV heads, tokens T and head_dim)")
    b, hkv, t, d = keys.shape
    if t < 1 or b < 1:
        raise MoendError(f"{where}: keys {tuple(keys.shape)} hold no tokens; allowed: B >= 1 and T >= 1")
    if queries is None:
        if needs_queries:
            raise MoendError(
                f"{where} ({config}) evicts with scorer {scorer!r}, which needs the "
                "prompt's last queries: pass queries (per layer [B, H, W, D] post-RoPE, e.g. recorded with "
                "moend_fx.eval.steps.QueryRecorder), or use scorer 'keynorm'/'streaming', or 'trig' with "
                "calibrated query_stats"
            )
    elif not isinstance(queries, torch.Tensor) or queries.dim() != 4:
        got = tuple(queries.shape) if isinstance(queries, torch.Tensor) else type(queries).__name__
        raise MoendError(f"{where}: queries must be a 4-D tensor [B, H, W, D] or None; got {got}")
    else:
        qb, h, w, qd = queries.shape
        if qb != b or qd != d or h < hkv or h % hkv or not 1 <= w <= t:
            raise MoendError(
                f"{where}: queries {tuple(queries.shape)} must be [B={b}, H, W, D={d}] with H a multiple of "
                f"Hkv={hkv} and 1 <= W <= T={t} (the last W prompt tokens' post-RoPE queries)"
            )
    return PrefillShape(b, hkv, t, d, 0 if queries is None else queries.shape[2])
