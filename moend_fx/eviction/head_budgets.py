"""Per-KV-head token counts within one layer (Ada-KV style): the heads of a layer share its ``n * Hkv`` kept
tokens by score instead of keeping ``n`` each.

Every head first keeps its ``floor`` most worth keeping tokens (its sinks and recent window at least; Ada-KV's
safeguard, a share ``alpha`` of the uniform count, protects heads whose scores are flat); the rest of the layer's
tokens go to the best scores across heads. Scores are standardised per (row, KV head) first, so a head whose few
tokens stand far above its own mean (a head that looks something up) wins them over a head that attends broadly.

The cache stores every head with one count (``docs/cache-format.md``): these counts are what
``moend bench head-budgets`` measures before a ragged layout is worth building.
"""

from __future__ import annotations

import math

import torch

from moend_fx.common.defaults import RECENT_TOKENS, SINK_TOKENS
from moend_fx.common.errors import MoendError
from moend_fx.eviction.selection import token_ranks

DEFAULT_ALPHA = 0.2  # Ada-KV's safeguard share


def head_counts(
    scores: torch.Tensor, n_keep: int, *, alpha: float = DEFAULT_ALPHA, sink_tokens: int = SINK_TOKENS,
    recent_tokens: int = RECENT_TOKENS, key_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tokens each KV head keeps [B, Hkv] int64, summing to ``n_keep * Hkv`` per row.

    scores: [B, Hkv, T] (higher = more worth keeping; -inf = never unless nothing else is left);
    n_keep: the layer's uniform count per head (1 <= n_keep <= T); alpha in [0, 1]: each head keeps at least
    ``max(ceil(alpha * n_keep), min(n_keep, sinks + recent))``; key_positions as in
    :func:`~moend_fx.eviction.selection.select_tokens`. A head keeps its tokens in the priority of
    :func:`~moend_fx.eviction.selection.select_tokens` (so ``keep_mask`` with these counts keeps, for every head,
    what ``select_tokens(scores, count)`` keeps)."""
    if not isinstance(scores, torch.Tensor) or scores.dim() != 3:
        raise MoendError(f"scores must be a [B, Hkv, T] tensor; got {getattr(scores, 'shape', type(scores))}")
    b, hkv, t = scores.shape
    if isinstance(n_keep, bool) or not isinstance(n_keep, int) or not 1 <= n_keep <= t:
        raise MoendError(f"n_keep={n_keep!r}; must be an int in [1, T={t}]")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise MoendError(f"alpha={alpha!r}; must be a number in [0, 1]")
    floor = min(n_keep, max(math.ceil(alpha * n_keep), sink_tokens + recent_tokens))
    ranks = token_ranks(scores, sink_tokens=sink_tokens, recent_tokens=recent_tokens, key_positions=key_positions)
    z = _standardise(scores)
    # A head's priority order is non-increasing in z past its floor (sinks and recent tokens lead; -inf last), so
    # the best n_keep * Hkv values across heads take a prefix of every head's order: its count.
    z = torch.where(ranks < floor, torch.inf, z)
    z = z.nan_to_num(nan=-torch.inf)
    flat = z.reshape(b, hkv * t)
    total = n_keep * hkv
    # descending value; equal values in a head's own priority order, so a count is always a prefix of it
    order = torch.argsort(ranks.reshape(b, hkv * t), dim=-1, stable=True)
    order = order.gather(1, torch.argsort(flat.gather(1, order), dim=-1, descending=True, stable=True))
    taken = torch.zeros(b, hkv * t, dtype=torch.bool, device=scores.device)
    taken.scatter_(1, order[:, :total], True)
    return taken.view(b, hkv, t).sum(-1)


def keep_mask(scores: torch.Tensor, counts: torch.Tensor, *, sink_tokens: int = SINK_TOKENS,
              recent_tokens: int = RECENT_TOKENS, key_positions: torch.Tensor | None = None) -> torch.Tensor:
    """bool [B, Hkv, T]: head h of row b keeps the ``counts[b, h]`` first tokens of its priority order.

    scores: [B, Hkv, T]; counts: [B, Hkv] (or [Hkv], broadcast) int, each in [0, T]."""
    ranks = token_ranks(scores, sink_tokens=sink_tokens, recent_tokens=recent_tokens, key_positions=key_positions)
    c = torch.as_tensor(counts, device=scores.device).long()
    if c.dim() == 1:
        c = c.expand(scores.shape[0], -1)
    if tuple(c.shape) != tuple(scores.shape[:2]):
        raise MoendError(f"counts {tuple(c.shape)} must be [B, Hkv] = {tuple(scores.shape[:2])}")
    return ranks < c[..., None]


def _standardise(scores: torch.Tensor) -> torch.Tensor:
    """scores [B, Hkv, T] as z-scores over each (row, head)'s finite entries (-inf stays -inf)."""
    s = scores.float()
    finite = torch.isfinite(s)
    n = finite.sum(-1, keepdim=True).clamp_min(1)
    x = torch.where(finite, s, 0.0)
    mean = x.sum(-1, keepdim=True) / n
    var = (torch.where(finite, s - mean, 0.0) ** 2).sum(-1, keepdim=True) / n
    return torch.where(finite, (s - mean) / var.sqrt().clamp_min(1e-6), s)
