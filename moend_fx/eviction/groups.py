"""Which packed groups a re-eviction keeps: whole groups, so that kept codes are never re-quantized.

K is quantized per channel over groups of G consecutive stored tokens, so dropping single tokens from packed
groups would regroup the survivors and quantize them again, from values already quantized once: the K error then
grows with every re-eviction (0.08 -> 0.19 relative after 8 rounds, measured). Re-evicting whole groups keeps
every surviving code, scale and zero bit for bit. The prompt itself is still evicted token by token, on the exact
K/V, before it is quantized at all.
"""

from __future__ import annotations

import torch


def groups_to_keep(ranks: torch.Tensor, packed: int, group_size: int, n_drop: int) -> torch.Tensor:
    """Indices [B, Hkv, packed // group_size - n_drop] (ascending) of the packed groups to keep.

    ranks: [B, Hkv, n] int64 token ranks (:func:`moend_fx.eviction.selection.token_ranks`, 0 = kept first); the
    first ``packed`` tokens (a multiple of ``group_size``) are the packed groups. A group is worth its best
    token, so a group holding a sink, a recent token or one high-scoring token outlives groups of
    low scorers; the ``n_drop`` worst groups go."""
    b, h, _ = ranks.shape
    groups = packed // group_size
    best = ranks[:, :, :packed].reshape(b, h, groups, group_size).amin(dim=-1)
    keep = best.argsort(dim=-1, stable=True)[..., : groups - n_drop]
    return keep.sort(dim=-1).values
