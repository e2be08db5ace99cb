"""H2O heavy hitters: attention accumulated over the given queries; the column sums snapkv shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from moend_fx.common.checks import check_int
from moend_fx.common.errors import MoendError
from moend_fx.common.options import ScorerName, Setting
from moend_fx.eviction.scorers.base import Scorer, Tensor
from moend_fx.eviction.scorers.inputs import as_key_positions, as_query_positions, check_keys, check_queries


def check_attention_options(scorer: str, scale: float | None, chunk: int) -> None:
    """``scale`` None (1/sqrt(D)) or > 0; ``chunk`` (queries per softmax block) a positive int."""
    if scale is not None and not scale > 0:
        raise MoendError(f"{scorer} scale={scale!r}; must be > 0")
    check_int(f"{scorer} chunk", chunk)


def attention_column_sums(queries: Tensor, keys: Tensor, key_pos: Tensor, query_pos: Tensor | None, scale: float,
                          chunk: int) -> Tensor:
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


def column_sums(scorer: str, scale: float | None, chunk: int, keys: Tensor, values: Tensor, queries: Tensor | None,
                key_positions: Tensor, query_positions: Tensor | None, window: int | None = None) -> Tensor:
    """Checked inputs -> :func:`attention_column_sums` of the last ``window`` queries (None = all):
    [B, Hkv, G, T]. keys, values: [B, Hkv, T, D]; queries: [B, H, W, D]; positions as in ``base``."""
    check_keys(keys, values)
    queries = check_queries(queries, keys, scorer)
    kp = as_key_positions(key_positions, keys.shape)
    qp = as_query_positions(query_positions, keys.shape[0], queries.shape[2])
    if window is not None:
        queries = queries[:, :, -window:]
        qp = qp[:, -window:] if qp is not None else None
    scale = scale if scale is not None else keys.shape[-1] ** -0.5
    return attention_column_sums(queries, keys, kp, qp, scale, chunk)


@dataclass(frozen=True)
class H2OScorer(Scorer):
    """H2O heavy hitters: attention accumulated over all the given queries (columns summed).

    Causal by position (a key is visible to a query iff key_position <= query_position; no query_positions =
    all visible); mean over the query heads of each KV group. Queries are processed ``chunk`` at a time, so
    memory is O(chunk * T) even for a whole prefill.
    """

    name: ClassVar[str] = ScorerName.H2O
    setting: ClassVar[str] = Setting.QUERY_AWARE
    scale: float | None = None
    chunk: int = 128

    def __post_init__(self) -> None:
        check_attention_options(self.name, self.scale, self.chunk)

    def score(self, keys: Tensor, values: Tensor, *, queries: Tensor | None = None, key_positions: Tensor,
              query_positions: Tensor | None = None) -> Tensor:
        """keys, values: [B, Hkv, T, D]; queries: [B, H, W, D]; key_positions: [B, Hkv, T]; query_positions:
        [B, W] or None. Returns [B, Hkv, T]."""
        att = column_sums(self.name, self.scale, self.chunk, keys, values, queries, key_positions, query_positions)
        return att.mean(dim=2)
