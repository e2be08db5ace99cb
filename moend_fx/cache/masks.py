"""HF's attention mask as a cache layer reads it: bool over the logical slots, then at the held tokens."""

from __future__ import annotations

import torch

from moend_fx.common.errors import MoendError


def logical_mask(mask: torch.Tensor | None, n_queries: int, logical: int, where: str) -> torch.Tensor | None:
    """HF's mask [B, 1|H, L, S] (bool, or additive float: 0 = attend) as bool [B, 1, L, S] (True = may attend),
    or None. S must be the ``logical`` length (every token fed, evicted or not); ``where`` names the layer."""
    if mask is None:
        return None
    if mask.dim() != 4 or mask.shape[-1] != logical or mask.shape[-2] != n_queries:
        raise MoendError(
            f"{where}: attention mask {tuple(mask.shape)} must be [B, 1, L={n_queries}, "
            f"S={logical}] (the logical length); a custom 4D mask must cover every token fed"
        )
    if mask.dtype != torch.bool:
        mask = mask == 0  # additive float mask: 0 = attend, -inf (or min) = masked
    return mask[:, :1]


def held_mask(lmask: torch.Tensor, positions: torch.Tensor | None, num_tokens: int, num_heads: int) -> torch.Tensor:
    """Logical mask lmask [B, 1, L, S] -> [B, 1 or H, L, n] at the held tokens' slots positions [B, Hkv, n]
    (None: a layer that never evicts holds the first ``num_tokens`` slots)."""
    if positions is None:
        return lmask[..., :num_tokens]
    b, hkv, n = positions.shape
    l_q = lmask.shape[2]
    cols = positions.long()[:, :, None, :].expand(b, hkv, l_q, n)
    m = lmask.expand(b, hkv, l_q, lmask.shape[-1]).gather(3, cols)  # [B, Hkv, L, n]
    return m.repeat_interleave(num_heads // hkv, dim=1)
