"""Input checks every scorer (and the token selection) shares; shapes as in :mod:`moend_fx.eviction.scorers.base`."""

from __future__ import annotations

import torch

from moend_fx.common.errors import MoendError


def check_keys(keys: torch.Tensor, values: torch.Tensor | None) -> None:
    """keys must be [B, Hkv, T, D] with T >= 1; values (if given) [B, Hkv, T, Dv]."""
    if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
        raise MoendError(f"keys must be a [B, Hkv, T, D] tensor; got {getattr(keys, 'shape', type(keys))}")
    if keys.shape[2] == 0:
        raise MoendError("keys hold no tokens (T=0); nothing to score")
    if values is not None and (values.dim() != 4 or values.shape[:3] != keys.shape[:3]):
        raise MoendError(
            f"values {tuple(values.shape)} must be [B, Hkv, T, Dv] with B, Hkv, T of keys {tuple(keys.shape)}"
        )


def _check_int_tensor(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise MoendError(f"{name} must be an integer tensor; got {getattr(t, 'dtype', type(t))}")


def as_key_positions(key_positions: torch.Tensor | None, keys_shape: torch.Size) -> torch.Tensor:
    """key_positions as [B, Hkv, T] int64 (accepts [T], [B, T], [B, Hkv, T])."""
    b, hkv, t = keys_shape[0], keys_shape[1], keys_shape[2]
    if key_positions is None:
        raise MoendError("key_positions is required: [B, Hkv, T] original positions of the stored keys")
    _check_int_tensor("key_positions", key_positions)
    kp = key_positions.to(torch.int64)
    if kp.dim() == 1:
        kp = kp[None, None]
    elif kp.dim() == 2:
        kp = kp[:, None]
    if kp.dim() != 3 or kp.shape[-1] != t or kp.shape[0] not in (1, b) or kp.shape[1] not in (1, hkv):
        raise MoendError(
            f"key_positions {tuple(key_positions.shape)} must be [B, Hkv, T] = {(b, hkv, t)} (or [T], [B, T])"
        )
    return kp.expand(b, hkv, t)


def check_queries(queries: torch.Tensor | None, keys: torch.Tensor, scorer: str) -> torch.Tensor:
    """queries [B, H, W, D] checked against keys [B, Hkv, T, D] (H a multiple of Hkv, W >= 1); a MoendError
    naming ``scorer`` when they are missing."""
    if queries is None:
        raise MoendError(f"scorer '{scorer}' needs queries: [B, H, W, D] post-RoPE queries of the last W tokens")
    b, hkv, _, d = keys.shape
    if not isinstance(queries, torch.Tensor) or queries.dim() != 4:
        raise MoendError(f"queries must be a [B, H, W, D] tensor; got {getattr(queries, 'shape', type(queries))}")
    if queries.shape[0] != b or queries.shape[-1] != d or queries.shape[1] % hkv or queries.shape[2] == 0:
        raise MoendError(
            f"queries {tuple(queries.shape)} must be [B={b}, H=Hkv*group (Hkv={hkv}), W>0, D={d}] "
            f"to match keys {tuple(keys.shape)}"
        )
    return queries


def as_query_positions(query_positions: torch.Tensor | None, b: int, w: int) -> torch.Tensor | None:
    """query_positions as [B, W] int64 (accepts [W]); None stays None."""
    if query_positions is None:
        return None
    _check_int_tensor("query_positions", query_positions)
    qp = query_positions.to(torch.int64)
    if qp.dim() == 1:
        qp = qp[None]
    if qp.dim() != 2 or qp.shape[-1] != w or qp.shape[0] not in (1, b):
        raise MoendError(f"query_positions {tuple(query_positions.shape)} must be [B, W] = {(b, w)} (or [W])")
    return qp.expand(b, w)
