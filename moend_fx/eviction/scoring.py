"""Eviction scorers (one frozen dataclass each, kvpress style) and the per-KV-head token selection.

Every scorer has one method::

    score(keys, values, *, queries=None, key_positions, query_positions=None) -> [B, Hkv, T] float32

with higher = more worth keeping. Shapes:

* keys, values: [B, Hkv, T, D] post-RoPE, as stored in the HF cache (values may have another last dim).
* queries: [B, H, W, D] post-RoPE queries of the last W tokens, H = Hkv * group. Query head ``h`` reads
  KV head ``h // group`` (HF ``repeat_kv`` order).
* key_positions: [B, Hkv, T] int64 original positions (not contiguous after an earlier eviction);
  [T] and [B, T] are broadcast.
* query_positions: [B, W] (or [W]) int64.

Which inputs each scorer needs:

=========  ==========================================================================================
trig       keys, key_positions, a RopeSpec; query stats from ``stats=`` (calibrated) or else
           ``queries`` + ``query_positions`` (estimated on the fly)
snapkv     keys, queries; query_positions for causality (None = every key visible to every query)
h2o        keys, queries; query_positions as for snapkv
keynorm    keys
streaming  key_positions
=========  ==========================================================================================

Selection (:func:`select_tokens`) always keeps the first ``sink_tokens`` and last ``recent_tokens``
stored tokens, then the best scores; ties go to the later position, so results are reproducible.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from moend_fx.common.errors import MoendError
from moend_fx.eviction.rope import QueryStats, RopeSpec, invert_rope, to_complex
from moend_fx.eviction.scoring_inputs import (
    _attention_column_sums,
    _check_keys,
    _check_pooling,
    _key_positions,
    _pool_scores,
    _queries,
    _query_positions,
)
from moend_fx.eviction.selection import evict, select_tokens

__all__ = ["SCORERS", "Scorer", "get_scorer", "geometric_offsets", "select_tokens", "evict"]


# ---------------------------------------------------------------------------------------------- scorers


@dataclass(frozen=True)
class Scorer:
    """Base: subclasses set ``name`` and implement :meth:`score`."""

    name: ClassVar[str] = ""

    def score(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        queries: torch.Tensor | None = None,
        key_positions: torch.Tensor,
        query_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError


def geometric_offsets(max_offset: int) -> tuple[int, ...]:
    """1, 2, 4, ..., the largest power of two <= max_offset."""
    if max_offset < 1:
        raise MoendError(f"max_offset={max_offset!r}; must be >= 1")
    return tuple(2**i for i in range(int(math.log2(max_offset)) + 1))


@dataclass(frozen=True)
class TrigScorer(Scorer):
    """TriAttention-style frequency score: the expected logit a future query gives each key.

    For a query head with pre-RoPE complex mean ``qbar_f`` and mean magnitude ``E|q_f|`` per frequency f,
    and a key at position p with pre-RoPE pairs ``k_f``, the logit of a query at t is approximated by::

        sum_f |qbar_f| |k_f| cos(w_f (t - p) + arg qbar_f - arg k_f) + sum_f (E|q_f| - |qbar_f|) |k_f|

    (the second term: the part of the query that is not phase-coherent still scores through magnitude),
    averaged over ``t = t_now + delta`` for delta in ``offsets`` (default 1, 2, 4, ... up to
    ``max_offset``) with ``t_now`` = the last position seen + 1. The result carries RoPE's
    ``attention_scaling`` squared, like a real logit, but not the 1/sqrt(D) softmax scale.

    Implementation: ``k_f exp(i w_f p)`` is exactly the stored post-RoPE key pair (over the scaling),
    so the un-rotation by the key's own position cancels and the averaged first term is
    ``Re(sum_f c_f conj(krot_f))`` with ``c_f = qbar_f exp(i w_f t_now) mean_delta exp(i w_f delta)``:
    one matrix-vector product per head. The tests check it against the explicit un-rotated form.

    GQA: the score of a KV head is the mean over its query heads (linear, so the means are taken first).

    Key norm (``norm_weight``, default 1): the final score adds ``norm_weight`` times the standardised
    ``-||k||`` (Knorm's signal: low-norm keys draw attention) to the standardised trig score, both
    z-scored over the tokens of each (row, KV head). The frequency score alone favours tokens that suit
    an average future query; the norm term keeps content tokens (numbers, names) it undervalues.

    Pooling (default: max over ``kernel_size`` = 9 stored neighbours, as SnapKV pools its attention): a
    retrieved fact is a span ("The pass key is 72207."), and a per-token score keeps some of its tokens and
    drops others; max-pooling keeps the neighbours of every high-scoring token.

    Measured (SmolLM2-135M, query-agnostic passkey at 2k tokens, every layer keeping 12% at 16 bits):
    plain trig 0/4, max-pooled trig 4/4, with the norm term 4/4; keeping 7%: 0/3, 0/3, 3/3 (small samples:
    the evaluation in docs/results.md is the real test). ``pooling="none", norm_weight=0`` gives the plain
    TriAttention-style score.

    Stats: ``stats`` (a calibrated :class:`~moend_fx.eviction.rope.QueryStats` of this layer, [H] heads) or, if
    None, estimated from ``queries`` un-rotated with ``query_positions`` (per batch row).
    """

    name: ClassVar[str] = "trig"
    rope: RopeSpec | None = None
    stats: QueryStats | None = field(default=None, compare=False, repr=False)
    max_offset: int = 65536
    offsets: tuple[int, ...] | None = None
    pooling: str = "max"
    kernel_size: int = 9
    norm_weight: float = 1.0

    def __post_init__(self) -> None:
        _check_pooling("trig", self.pooling, self.kernel_size)
        if isinstance(self.norm_weight, bool) or not isinstance(self.norm_weight, (int, float)) or not (
                math.isfinite(self.norm_weight) and self.norm_weight >= 0):
            raise MoendError(f"trig norm_weight={self.norm_weight!r}; must be a finite number >= 0")
        if not isinstance(self.rope, RopeSpec):
            raise MoendError("trig scorer needs rope=RopeSpec (see moend_fx.eviction.rope.rope_from_model); "
                             f"got {self.rope!r}")
        if self.stats is not None:
            if not isinstance(self.stats, QueryStats):
                raise MoendError(f"trig stats must be a QueryStats; got {type(self.stats).__name__}")
            if self.stats.head_dim != self.rope.head_dim:
                raise MoendError(f"trig stats head_dim {self.stats.head_dim} != rope head_dim {self.rope.head_dim}")
            if self.stats.count == 0:
                raise MoendError("trig stats are empty (count=0)")
        if self.offsets is None:
            object.__setattr__(self, "offsets", geometric_offsets(self.max_offset))
        else:
            offs = tuple(int(o) for o in self.offsets)
            if not offs or any(o < 0 for o in offs):
                raise MoendError(f"trig offsets={self.offsets!r}; must be a non-empty tuple of ints >= 0")
            object.__setattr__(self, "offsets", offs)

    def _query_terms(
        self, queries: torch.Tensor | None, query_positions: torch.Tensor | None, b: int, hkv: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(qbar [B|1, H, F] complex128, E|q| - |qbar| [B|1, H, F] float64)."""
        if self.stats is not None:
            qbar, eabs = self.stats.mean[None], self.stats.abs_mean[None]
        else:
            if queries is None or query_positions is None:
                raise MoendError(
                    "trig scorer needs calibrated stats=QueryStats, or queries [B, H, W, D] and "
                    "query_positions [B, W] to estimate them"
                )
            z = to_complex(invert_rope(queries.double(), query_positions, self.rope))  # [B, H, W, F]
            qbar, eabs = z.mean(dim=2), z.abs().mean(dim=2)
        if qbar.shape[1] % hkv:
            raise MoendError(f"trig: {qbar.shape[1]} query heads is not a multiple of Hkv={hkv}")
        return qbar, eabs - qbar.abs()

    def score(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        queries: torch.Tensor | None = None,
        key_positions: torch.Tensor,
        query_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _check_keys(keys, values)
        b, hkv, t, d = keys.shape
        if d != self.rope.head_dim:
            raise MoendError(f"trig: keys head_dim {d} != rope head_dim {self.rope.head_dim}")
        kp = _key_positions(key_positions, keys.shape)
        if queries is not None:
            _queries(queries, keys, self.name)
        qp = _query_positions(query_positions, b, queries.shape[2]) if queries is not None else None
        qbar, incoherent = self._query_terms(queries, qp, b, hkv)
        h = qbar.shape[1]
        g = h // hkv

        t_now = kp.reshape(b, -1).amax(dim=1)  # [B]
        if qp is not None:
            t_now = torch.maximum(t_now, qp.amax(dim=1))
        t_now = (t_now + 1).cpu().double()
        w = torch.tensor(self.rope.inv_freq, dtype=torch.float64)  # [F]
        deltas = torch.tensor(self.offsets, dtype=torch.float64)  # [N]
        ang = deltas[:, None] * w  # [N, F]
        avg_phase = torch.polar(torch.ones_like(ang), ang).mean(dim=0)  # [F]
        # float64 phases: t_now * w reaches 1e5 rad at long contexts
        ang = t_now[:, None] * w
        now_phase = torch.polar(torch.ones_like(ang), ang)  # [B, F]
        s = self.rope.attention_scaling
        c = qbar.cpu() * (now_phase * avg_phase)[:, None, :] * s  # [B, H, F]
        c = c.reshape(c.shape[0], hkv, g, -1).mean(dim=2)  # [B|1, Hkv, F]
        m = (incoherent.cpu() * s).reshape(incoherent.shape[0], hkv, g, -1).mean(dim=2)  # [B|1, Hkv, F]

        k = keys.float()
        half = d // 2
        # keys are [re | im] halves already, so Re(c conj(krot)) = k_re . c_re + k_im . c_im
        cvec = torch.cat((c.real, c.imag), dim=-1).to(device=keys.device, dtype=torch.float32)  # [B, Hkv, D]
        coherent = torch.matmul(k, cvec.expand(b, hkv, d)[..., None])[..., 0]  # [B, Hkv, T]
        kabs = torch.hypot(k[..., :half], k[..., half:])  # |krot_f| = s |k_f|: [B, Hkv, T, F]
        mvec = m.to(device=keys.device, dtype=torch.float32).expand(b, hkv, half)
        magnitude = torch.matmul(kabs, mvec[..., None])[..., 0]
        score = (coherent + magnitude).float()  # [B, Hkv, T]
        if self.norm_weight:
            score = _standardise(score) + self.norm_weight * _standardise(-k.norm(dim=-1))
        return _pool_scores(score, self.kernel_size, self.pooling)


def _standardise(x: torch.Tensor) -> torch.Tensor:
    """z-score x [B, Hkv, T] over its tokens (a constant row becomes zeros)."""
    mu = x.mean(dim=-1, keepdim=True)
    sd = x.std(dim=-1, keepdim=True, correction=0)
    return (x - mu) / sd.clamp_min(1e-12)


def _column_sums(scorer: Any, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None,
                 key_positions: torch.Tensor, query_positions: torch.Tensor | None,
                 window: int | None = None) -> torch.Tensor:
    """Attention of the (last ``window``) queries summed per key: [B, Hkv, G, T] (snapkv and h2o share it)."""
    _check_keys(keys, values)
    queries, _ = _queries(queries, keys, scorer.name)
    kp = _key_positions(key_positions, keys.shape)
    qp = _query_positions(query_positions, keys.shape[0], queries.shape[2])
    if window is not None:
        queries = queries[:, :, -window:]
        qp = qp[:, -window:] if qp is not None else None
    scale = scorer.scale if scorer.scale is not None else keys.shape[-1] ** -0.5
    return _attention_column_sums(queries, keys, kp, qp, scale, scorer.chunk)


@dataclass(frozen=True)
class SnapKVScorer(Scorer):
    """SnapKV: attention of the observation window over all keys, summed over the window, pooled.

    softmax(q k^T * scale) with scale = 1/sqrt(D) by default, causal by position (a key is visible to a
    window query iff key_position <= query_position; no query_positions = all visible), summed over the
    last ``window`` given queries (None = all), ``pooling`` ("avg", "max" or "none") with ``kernel_size`` along the
    stored tokens, then averaged over the query heads of each KV group.
    """

    name: ClassVar[str] = "snapkv"
    window: int | None = None
    kernel_size: int = 5
    pooling: str = "avg"
    scale: float | None = None
    chunk: int = 256

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise MoendError(f"snapkv window={self.window!r}; must be >= 1 or None")
        _check_pooling("snapkv", self.pooling, self.kernel_size)
        if self.scale is not None and not self.scale > 0:
            raise MoendError(f"snapkv scale={self.scale!r}; must be > 0")
        if self.chunk < 1:
            raise MoendError(f"snapkv chunk={self.chunk!r}; must be >= 1")

    def score(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        queries: torch.Tensor | None = None,
        key_positions: torch.Tensor,
        query_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        att = _column_sums(self, keys, values, queries, key_positions, query_positions, self.window)
        return _pool_scores(att, self.kernel_size, self.pooling).mean(dim=2)  # [B, Hkv, G, T] -> [B, Hkv, T]


@dataclass(frozen=True)
class H2OScorer(Scorer):
    """H2O heavy hitters: attention accumulated over all the given queries (columns summed).

    Causal by position as :class:`SnapKVScorer`; mean over the query heads of each KV group. Queries are
    processed ``chunk`` at a time, so memory is O(chunk * T) even for a whole prefill.
    """

    name: ClassVar[str] = "h2o"
    scale: float | None = None
    chunk: int = 128

    def __post_init__(self) -> None:
        if self.scale is not None and not self.scale > 0:
            raise MoendError(f"h2o scale={self.scale!r}; must be > 0")
        if self.chunk < 1:
            raise MoendError(f"h2o chunk={self.chunk!r}; must be >= 1")

    def score(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        queries: torch.Tensor | None = None,
        key_positions: torch.Tensor,
        query_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return _column_sums(self, keys, values, queries, key_positions, query_positions).mean(dim=2)


@dataclass(frozen=True)
class KeyNormScorer(Scorer):
    """Knorm: score = -||k|| (low-norm keys draw attention; keep them). Needs keys only."""

    name: ClassVar[str] = "keynorm"

    def score(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        queries: torch.Tensor | None = None,
        key_positions: torch.Tensor,
        query_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _check_keys(keys, values)
        _key_positions(key_positions, keys.shape)
        return -keys.float().norm(dim=-1)


@dataclass(frozen=True)
class StreamingScorer(Scorer):
    """StreamingLLM: score = key position, so the selection keeps the sinks plus the most recent tokens."""

    name: ClassVar[str] = "streaming"

    def score(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        queries: torch.Tensor | None = None,
        key_positions: torch.Tensor,
        query_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _check_keys(keys, values)
        return _key_positions(key_positions, keys.shape).float().contiguous()


SCORERS: dict[str, type[Scorer]] = {
    "trig": TrigScorer,
    "snapkv": SnapKVScorer,
    "keynorm": KeyNormScorer,
    "streaming": StreamingScorer,
    "h2o": H2OScorer,
}


def get_scorer(name: str, **kwargs: Any) -> Scorer:
    """Build a scorer by name; kwargs go to its dataclass, e.g. ``get_scorer("trig", rope=spec, stats=s)``."""
    if name not in SCORERS:
        raise MoendError(f"unknown scorer {name!r}; allowed: {sorted(SCORERS)}")
    cls = SCORERS[name]
    allowed = [f.name for f in dataclasses.fields(cls) if f.init]
    bad = sorted(set(kwargs) - set(allowed))
    if bad:
        raise MoendError(f"scorer {name!r} takes no option(s) {bad}; allowed: {allowed}")
    return cls(**kwargs)
