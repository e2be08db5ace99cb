"""HF's attention mask as a cache layer reads it: bool over the logical slots, then at the held tokens; and the
attention of a step's queries over the held tokens with it (:func:`held_attention`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from moend_fx.attention.reference import chunk_causal_mask
from moend_fx.common.errors import MoendError
from moend_fx.storage.packed import PackedKV

# A prefill chunk's attention over a per-head mask runs SDPA's math path, which materialises the [B, H, L, n]
# scores: ~700 MB for a 2048-token chunk of Qwen2.5-0.5B over 6k held tokens, more than the one-shot prefill's
# flash attention ever holds. Query rows are attended in blocks of at most this many score elements (~50 MB of
# fp32 scores, probabilities and mask at a time).
CHUNK_SCORE_ELEMENTS = 1 << 22


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


def held_attention(attention_fn: Callable[..., torch.Tensor], query: torch.Tensor, packed: PackedKV,
                   lmask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """Attention of query: [B, H, L, D] (the newest L held tokens) over the held tokens of ``packed``
    (K/V [B, Hkv, n, D]) under the logical mask lmask: [B, 1, L, S] bool or None. Returns [B, H, L, D].

    A decode step (L = 1) passes the mask gathered at the held slots (the form the compiled decode graph has). A
    chunk (L > 1) whose mask is plainly causal (no padding) passes none: every kept past token precedes every query
    and the chunk is the newest L held tokens, so ``attention_fn``'s own bottom-right causal mask is the whole mask
    and SDPA takes its flash path (memory O(L), not O(L n)). Otherwise the chunk's rows are attended in blocks of
    :data:`CHUNK_SCORE_ELEMENTS` scores, each with its rows of (gathered mask AND the chunk's causal mask): a
    block's own bottom-right mask only allows more, so the result is that of one call over all rows."""
    (b, h, n_q, _), n = query.shape, packed.num_tokens
    if n_q == 1:
        m = None if lmask is None else held_mask(lmask, packed.positions, n, h)
        return attention_fn(query, packed, scale=scale, causal_chunk=True, mask=m)
    if lmask is None or bool((lmask == chunk_causal_mask(n_q, lmask.shape[-1], lmask.device)).all()):
        return attention_fn(query, packed, scale=scale, causal_chunk=True, mask=None)
    rows, causal = max(1, CHUNK_SCORE_ELEMENTS // (b * h * n)), chunk_causal_mask(n_q, n, query.device)
    outs = [attention_fn(query[:, :, r:r + rows], packed, scale=scale, causal_chunk=True,
                         mask=held_mask(lmask[:, :, r:r + rows], packed.positions, n, h) & causal[r:r + rows])
            for r in range(0, n_q, rows)]
    return torch.cat(outs, dim=2)
