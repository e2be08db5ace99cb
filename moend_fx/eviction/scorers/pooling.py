"""Smoothing per-token scores over neighbouring stored tokens (trig and snapkv pool)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moend_fx.common.checks import check_choice
from moend_fx.common.errors import MoendError
from moend_fx.common.options import Pooling


def check_pooling(scorer: str, pooling: str, kernel_size: int) -> Pooling:
    """The :class:`Pooling` member named ``pooling``; ``kernel_size`` must be an odd int >= 1 (a centred window)."""
    member = check_choice(f"{scorer} pooling", pooling, Pooling)
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
        raise MoendError(f"{scorer} kernel_size={kernel_size!r}; must be an odd int >= 1")
    return member


def pool_scores(scores: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """Pool scores [..., T] along the stored tokens ("max", "avg" or "none"); same shape out.

    Tokens scored -inf (padding) stay -inf: pooling must not lift them with a real neighbour's score.
    """
    if pooling == Pooling.NONE or kernel_size == 1:
        return scores
    shape = scores.shape
    flat = scores.reshape(-1, 1, shape[-1])
    pad = kernel_size // 2
    if pooling == Pooling.AVG:
        # -inf neighbours would poison an average: pool the finite part only
        finite = torch.isfinite(flat)
        num = F.avg_pool1d(torch.where(finite, flat, 0.0), kernel_size, stride=1, padding=pad,
                           count_include_pad=False)
        den = F.avg_pool1d(finite.to(flat.dtype), kernel_size, stride=1, padding=pad, count_include_pad=False)
        pooled = num / den.clamp_min(1e-12)
    else:
        pooled = F.max_pool1d(flat, kernel_size, stride=1, padding=pad)
    pooled = pooled.reshape(shape)
    return torch.where(scores == float("-inf"), scores, pooled)
