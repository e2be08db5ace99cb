"""Gathering tokens along the token axis: the one place "keep these token indices" is spelled out."""

from __future__ import annotations

import torch


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Tokens ``index`` of x along dim 2.

    x: [B, H, T] (positions, scores) or [B, H, T, D] (keys, values); index: [B, H, n] int64 into T.
    Returns [B, H, n] or [B, H, n, D].
    """
    if x.dim() == 3:
        return x.gather(2, index)
    return x.gather(2, index[..., None].expand(*index.shape, x.shape[-1]))
