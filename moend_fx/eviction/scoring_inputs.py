"""Input checks and shared maths for the eviction scorers (shapes as in :mod:`moend_fx.eviction.scoring`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moend_fx.common.errors import MoendError

POOLINGS = ("max", "avg", "none")


def _check_pooling(scorer: str, pooling: str, kernel_size: int) -> None:
    if pooling not in POOLINGS:
        raise MoendError(f"{scorer} pooling={pooling!r}; allowed: {list(POOLINGS)}")
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
        raise MoendError(f"{scorer} kernel_size={kernel_size!r}; must be an odd int >= 1")


def _pool_scores(scores: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """Pool scores [..., T] along the stored tokens ("max", "avg" or "none"); same shape out.

    Tokens scored -inf (padding) stay -inf: pooling must not lift them with a real neighbour's score.
    """
    if pooling == "none" or kernel_size == 1:
        return scores
    shape = scores.shape
    flat = scores.reshape(-1, 1, shape[-1])
    pad = kernel_size // 2
    if pooling == "avg":
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


def _check_keys(keys: torch.Tensor, values: torch.Tensor | None) -> None:
    if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
        raise MoendError(f"keys must be a [B, Hkv, T, D] tensor; got {getattr(keys, 'shape', type(keys))}")
    if keys.shape[2] == 0:
        raise MoendError("keys hold no tokens (T=0); nothing to score")
    if values is not None and (values.dim() != 4 or values.shape[:3] != keys.shape[:3]):
        raise MoendError(
            f"values {tuple(values.shape)} must be [B, Hkv, T, Dv] with B, Hkv, T of keys {tuple(keys.shape)}"
        )


def _int_tensor(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise MoendError(f"{name} must be an integer tensor; got {getattr(t, 'dtype', type(t))}")


def _key_positions(key_positions: torch.Tensor | None, keys_shape: torch.Size) -> torch.Tensor:
    """key_positions as [B, Hkv, T] int64 (accepts [T], [B, T], [B, Hkv, T])."""
    b, hkv, t = keys_shape[0], keys_shape[1], keys_shape[2]
    if key_positions is None:
        raise MoendError("key_positions is required: [B, Hkv, T] original positions of the stored keys")
    _int_tensor("key_positions", key_positions)
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


def _queries(
    queries: torch.Tensor | None, keys: torch.Tensor, scorer: str, needed: bool = True
) -> tuple[torch.Tensor | None, int]:
    """Check queries [B, H, W, D] against keys; return (queries, group)."""
    if queries is None:
        if needed:
            raise MoendError(f"scorer {scorer!r} needs queries: [B, H, W, D] post-RoPE queries of the last W tokens")
        return None, 0
    b, hkv, _, d = keys.shape
    if not isinstance(queries, torch.Tensor) or queries.dim() != 4:
        raise MoendError(f"queries must be a [B, H, W, D] tensor; got {getattr(queries, 'shape', type(queries))}")
    if queries.shape[0] != b or queries.shape[-1] != d or queries.shape[1] % hkv or queries.shape[2] == 0:
        raise MoendError(
            f"queries {tuple(queries.shape)} must be [B={b}, H=Hkv*group (Hkv={hkv}), W>0, D={d}] "
            f"to match keys {tuple(keys.shape)}"
        )
    return queries, queries.shape[1] // hkv


def _query_positions(query_positions: torch.Tensor | None, b: int, w: int) -> torch.Tensor | None:
    """query_positions as [B, W] int64 (accepts [W])."""
    if query_positions is None:
        return None
    _int_tensor("query_positions", query_positions)
    qp = query_positions.to(torch.int64)
    if qp.dim() == 1:
        qp = qp[None]
    if qp.dim() != 2 or qp.shape[-1] != w or qp.shape[0] not in (1, b):
        raise MoendError(f"query_positions {tuple(query_positions.shape)} must be [B, W] = {(b, w)} (or [W])")
    return qp.expand(b, w)


def _attention_column_sums(
    queries: torch.Tensor,
    keys: torch.Tensor,
    key_pos: torch.Tensor,
    query_pos: torch.Tensor | None,
    scale: float,
    chunk: int,
) -> torch.Tensor:
    """Sum over queries of softmax(q k^T * scale), causal by position: [B, Hkv, group, T] float32.

    queries: [B, H, W, D]; keys: [B, Hkv, T, D]; key_pos: [B, Hkv, T]; query_pos: [B, W] or None
    (every key visible). Runs ``chunk`` queries at a time so memory is O(chunk * T), not O(W * T).
    """
    b, hkv, t, d = keys.shape
    g = queries.shape[1] // hkv
    w = queries.shape[2]
    q = queries.float().reshape(b, hkv, g, w, d)
    k = keys.float()
    out = torch.zeros(b, hkv, g, t, dtype=torch.float32, device=keys.device)
    for s in range(0, w, chunk):  # a loop over query chunks, not tokens: W / chunk iterations
        logits = torch.einsum("bhgwd,bhtd->bhgwt", q[:, :, :, s : s + chunk], k) * scale
        if query_pos is not None:
            visible = key_pos[:, :, None, None, :] <= query_pos[:, None, None, s : s + chunk, None]
            logits = logits.masked_fill(~visible, float("-inf"))
        # a query that sees no key (all -inf) gives NaN rows; it attends to nothing
        out += torch.softmax(logits, dim=-1).nan_to_num_(0.0).sum(dim=3)
    return out
