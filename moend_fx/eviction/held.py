"""The tokens an eviction reads: a prompt not yet compressed (:class:`DenseKV`), which held tokens are real
(:class:`RealTokens`), and row-by-row eviction of a padded batch (:func:`evict_rows`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from moend_fx.storage.tokens import gather_tokens

Select = Callable[..., torch.Tensor]
Score = Callable[..., torch.Tensor]


class DenseKV(NamedTuple):
    """A prompt not yet compressed: keys, values [B, Hkv, n, D] post-RoPE, positions [B, Hkv, n] int (their
    logical slots; None for a layer that never evicts)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor | None


class RealTokens(NamedTuple):
    """Which held tokens of each row are real (not padding), from the step's mask.

    valid: [B, Hkv, n] bool (None = all real); last: [B, S] bool, the mask row of the newest query, which sees
    every real token (None = no mask); seen, held: [B] real tokens seen so far and held."""

    valid: torch.Tensor | None
    last: torch.Tensor | None
    seen: torch.Tensor
    held: torch.Tensor

    @classmethod
    def of(cls, pos: torch.Tensor, lmask: torch.Tensor | None, logical: int) -> RealTokens:
        """pos: [B, Hkv, n] int64 slots of the held tokens; lmask: bool [B, 1, L, S] or None; logical: S."""
        b, hkv, n = pos.shape
        valid = last = None
        if lmask is not None:
            last = lmask[:, 0, -1, :]
            seen = last.sum(-1)
            valid = last.gather(1, pos.reshape(b, -1)).reshape(b, hkv, n)
            if bool(valid.all()):
                valid = None
        else:
            seen = torch.full((b,), logical, dtype=torch.long)
        held = torch.full((b,), n, dtype=torch.long) if valid is None else valid[:, 0].sum(-1)
        return cls(valid, last, seen, held)


def real_at(lmask: torch.Tensor | None, pos: torch.Tensor) -> torch.Tensor | None:
    """Which of the tokens at slots pos [B, Hkv, n] are real [B, Hkv, n] bool, by the mask row of the newest query
    of lmask [B, 1, L, S] (None, or every token real: None)."""
    if lmask is None:
        return None
    b, hkv, n = pos.shape
    valid = lmask[:, 0, -1, :].gather(1, pos.reshape(b, -1).to(lmask.device)).reshape(b, hkv, n)
    return None if bool(valid.all()) else valid


def _top_up(k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, fill: int, pad_slot: int,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v: [1, Hkv, m, D], pos: [1, Hkv, m] plus ``fill`` zero tokens at slot ``pad_slot`` (a padding slot of
    this row, so the gathered mask hides them), in position order: [1, Hkv, m + fill(, D)]."""
    hkv = k.shape[1]
    k = torch.cat([k.new_zeros(1, hkv, fill, k.shape[-1]), k], dim=2)
    v = torch.cat([v.new_zeros(1, hkv, fill, v.shape[-1]), v], dim=2)
    pos = torch.cat([pos.new_full((1, hkv, fill), pad_slot), pos], dim=2)
    order = pos.argsort(dim=2, stable=True)
    return gather_tokens(k, order), gather_tokens(v, order), gather_tokens(pos, order)


def evict_rows(k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, real: RealTokens, targets: torch.Tensor,
               select: Select, window_slots: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Evict row by row over each row's real tokens only, so a padded row keeps exactly what it would keep
    alone; rows short of the common length ``max(targets)`` are topped up with masked filler tokens.

    k, v: [B, Hkv, n, D]; pos: [B, Hkv, n]; targets: [B]; select: the evictor's token selection (k, v, pos of one
    row, n_keep, the row, which window queries are real) -> indices [1, Hkv, n_keep]; window_slots: [W] the
    slots of the scorer's query window (None: no window). Returns k, v, pos with max(targets) tokens."""
    n = int(targets.max())
    rows = [_evict_row(k, v, pos, real, r, int(targets[r]), n, select, window_slots) for r in range(k.shape[0])]
    ks, vs, ps = zip(*rows)
    return torch.cat(ks), torch.cat(vs), torch.cat(ps)


def _evict_row(k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, real: RealTokens, r: int, target: int, n: int,
               select: Select, window_slots: torch.Tensor | None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row ``r`` of :func:`evict_rows`: [1, Hkv, n(, D)]."""
    if real.valid is None:
        keep = torch.arange(k.shape[2], device=k.device)
    else:
        keep = real.valid[r, 0].nonzero().squeeze(-1)  # pads sit at the same slots in every KV head
    q_keep = None
    if window_slots is not None and real.last is not None:
        q_keep = real.last[r].gather(0, window_slots.to(real.last.device))
    pads = (~real.last[r]).nonzero() if real.last is not None else None
    n_r = target if pads is not None and len(pads) else n
    one = slice(r, r + 1)
    idx = select(k[one, :, keep], v[one, :, keep], pos[one, :, keep], n_r, r, q_keep)
    idx = keep[idx]  # [1, Hkv, n_r] into the held tokens
    kr, vr, pr = gather_tokens(k[one], idx), gather_tokens(v[one], idx), gather_tokens(pos[one], idx)
    if n_r < n:
        kr, vr, pr = _top_up(kr, vr, pr, n - n_r, int(pads[0]))
    return kr, vr, pr


def real_row_scores(k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, score: Score,
                    ) -> torch.Tensor:
    """Scores [B, Hkv, n] of k, v: [B, Hkv, n, D] at slots pos [B, Hkv, n], each row scored on its real tokens
    alone (valid: [B, Hkv, n] bool, the same count on every head of a row), padding -inf: a scorer that
    standardises over the tokens must not see a row's padding, or a padded row evicts differently alone.
    score: the evictor's scoring (k, v, pos of one row, the row, which window queries are real) -> [1, Hkv, n]."""
    out = torch.full(pos.shape, float("-inf"), device=k.device)
    for b in range(pos.shape[0]):
        n = int(valid[b, 0].sum())
        if n == 0:
            continue
        idx = torch.argsort((~valid[b]).to(torch.int8), dim=-1, stable=True)[None, :, :n]  # [1, Hkv, n]
        row = slice(b, b + 1)
        s = score(gather_tokens(k[row], idx), gather_tokens(v[row], idx), pos[row].gather(-1, idx), b, None)
        out[row] = out[row].scatter(-1, idx, s.to(out.dtype))
    return out
