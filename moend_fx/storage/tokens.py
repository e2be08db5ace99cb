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


def fill_pads(x: torch.Tensor, valid: torch.Tensor, group_size: int) -> torch.Tensor:
    """x with each padding token replaced by the first real token of its group of ``group_size`` tokens, so that
    padding never widens a per-channel quantization group's min/max (a group of padding only keeps its values:
    nothing real is quantized with them).

    x: [B, H, n, D]; valid: [B, H, n] bool, True for real tokens. Groups run from token 0, as K's do; the last,
    partial group is the residual window, which later tokens complete: its padding takes its first real token."""
    b, h, n, d = x.shape
    g = group_size
    groups = -(-n // g)
    v = torch.nn.functional.pad(valid, (0, groups * g - n)).reshape(b, h, groups, g)
    first = v.to(torch.int8).argmax(dim=-1)  # [B, H, groups]: index in the group of its first real token
    src = (torch.arange(groups, device=x.device) * g + first).clamp_max(n - 1)  # token each group's pads copy
    fill = gather_tokens(x, src.repeat_interleave(g, dim=-1)[..., :n])
    return torch.where(valid[..., None], x, fill)
