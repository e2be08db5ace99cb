"""Per-KV-head token selection: sinks and the recent window always, then the best scores.

Ties go to the later position, so results are reproducible. Shapes as in :mod:`moend_fx.eviction.scorers.base`.
"""

from __future__ import annotations

import torch

from moend_fx.common.defaults import RECENT_TOKENS, SINK_TOKENS
from moend_fx.common.errors import MoendError
from moend_fx.eviction.scorers.inputs import as_key_positions, check_keys
from moend_fx.plan.memory import keep_count
from moend_fx.storage.tokens import gather_tokens


def select_tokens(
    scores: torch.Tensor,
    n_keep: int,
    *,
    sink_tokens: int = SINK_TOKENS,
    recent_tokens: int = RECENT_TOKENS,
    key_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``n_keep`` tokens per (batch row, KV head).

    scores: [B, Hkv, T]; key_positions: [B, Hkv, T] ([T], [B, T] broadcast; None = 0..T-1).
    Returns (indices [B, Hkv, n_keep] int64 sorted ascending, kept_positions [B, Hkv, n_keep] int64).

    Priority, highest first: the first ``sink_tokens`` stored tokens (earliest first), the last
    ``recent_tokens`` stored tokens (latest first), then by score, ties to the later position.
    So when ``n_keep < sink_tokens + recent_tokens`` the sinks are kept first and then the most recent
    tokens that fit. Sinks and recent tokens are kept whatever their score; other tokens scored -inf or
    NaN (e.g. padding) are kept only when nothing else is left.
    """
    if not isinstance(scores, torch.Tensor) or scores.dim() != 3:
        raise MoendError(f"scores must be a [B, Hkv, T] tensor; got {getattr(scores, 'shape', type(scores))}")
    b, hkv, t = scores.shape
    if isinstance(n_keep, bool) or not isinstance(n_keep, int) or not 1 <= n_keep <= t:
        raise MoendError(f"n_keep={n_keep!r}; must be an int in [1, T={t}] (see moend_fx.plan.memory.keep_count)")
    if sink_tokens < 0 or recent_tokens < 0:
        raise MoendError(f"sink_tokens={sink_tokens!r}, recent_tokens={recent_tokens!r}; both must be >= 0")
    kp = _positions(scores, key_positions)
    order = _priority_order(scores, kp, sink_tokens, recent_tokens)
    indices = order[..., :n_keep].sort(dim=-1).values
    return indices, gather_tokens(kp, indices)


def _positions(scores: torch.Tensor, key_positions: torch.Tensor | None) -> torch.Tensor:
    """key_positions broadcast to scores' [B, Hkv, T] (None = 0..T-1)."""
    b, hkv, t = scores.shape
    if key_positions is None:
        return torch.arange(t, device=scores.device).expand(b, hkv, t)
    return as_key_positions(key_positions, torch.Size((b, hkv, t))).to(scores.device)


def _priority_order(scores: torch.Tensor, kp: torch.Tensor, sink_tokens: int, recent_tokens: int) -> torch.Tensor:
    """Token indices [B, Hkv, T], most worth keeping first (the priority of :func:`select_tokens`).

    scores: [B, Hkv, T]; kp: [B, Hkv, T] positions (ties go to the later one)."""
    b, hkv, t = scores.shape
    s = scores.float().nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    idx = torch.arange(t, device=scores.device)
    # tier: sinks (earlier first) > recent (later first) > scored > -inf; ints so ties are exact
    tier = torch.where(s == float("-inf"), 0, 1).to(torch.int64)
    recent = idx >= t - recent_tokens
    sink = idx < sink_tokens
    tier = torch.where(recent, 2 * t + idx, tier)
    tier = torch.where(sink, 4 * t - idx, tier)

    # lexicographic (tier, score, position) descending with stable sorts, least significant key first
    order = torch.argsort(kp, dim=-1, descending=True, stable=True)
    o = torch.argsort(gather_tokens(s, order), dim=-1, descending=True, stable=True)
    order = gather_tokens(order, o)
    o = torch.argsort(gather_tokens(tier.expand(b, hkv, t), order), dim=-1, descending=True, stable=True)
    return gather_tokens(order, o)


def token_ranks(
    scores: torch.Tensor, *, sink_tokens: int = SINK_TOKENS, recent_tokens: int = RECENT_TOKENS,
    key_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each token's rank [B, Hkv, T] int64 in the priority of :func:`select_tokens` (0 = kept first), so that
    ``select_tokens(scores, n)`` keeps exactly the tokens of rank < n. Shapes as in :func:`select_tokens`."""
    b, hkv, t = scores.shape
    order = _priority_order(scores, _positions(scores, key_positions), sink_tokens, recent_tokens)
    ranks = torch.empty_like(order)
    return ranks.scatter_(2, order, torch.arange(t, device=scores.device).expand(b, hkv, t).contiguous())


def evict(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor,
    keep_ratio: float,
    *,
    key_positions: torch.Tensor | None = None,
    sink_tokens: int = SINK_TOKENS,
    recent_tokens: int = RECENT_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep ``keep_count(T, keep_ratio, floor=sink_tokens + recent_tokens)`` tokens per KV head (what a cache
    layer keeps) and gather them.

    keys: [B, Hkv, T, D]; values: [B, Hkv, T, Dv]; scores: [B, Hkv, T]; key_positions as in
    :func:`select_tokens`. Returns (keys [B, Hkv, n, D], values [B, Hkv, n, Dv], positions [B, Hkv, n]).
    """
    check_keys(keys, values)
    if tuple(scores.shape) != tuple(keys.shape[:3]):
        raise MoendError(f"scores {tuple(scores.shape)} must be [B, Hkv, T] = {tuple(keys.shape[:3])}")
    if isinstance(keep_ratio, bool) or not isinstance(keep_ratio, (int, float)) or not 0 < keep_ratio <= 1:
        raise MoendError(f"keep_ratio={keep_ratio!r}; must be in (0, 1]")
    n = keep_count(keys.shape[2], float(keep_ratio), floor=sink_tokens + recent_tokens)
    indices, positions = select_tokens(
        scores, n, sink_tokens=sink_tokens, recent_tokens=recent_tokens, key_positions=key_positions
    )
    return gather_tokens(keys, indices), gather_tokens(values, indices), positions
