"""TriAttention-style frequency score: the expected logit a future query gives each key."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from moend_fx.common.errors import MoendError
from moend_fx.common.options import Pooling, ScorerName
from moend_fx.eviction.query_stats import QueryStats
from moend_fx.eviction.rope import RopeSpec, invert_rope, to_complex
from moend_fx.eviction.scorers.base import Scorer, Tensor
from moend_fx.eviction.scorers.inputs import as_key_positions, as_query_positions, check_keys, check_queries
from moend_fx.eviction.scorers.pooling import check_pooling, pool_scores


def geometric_offsets(max_offset: int) -> tuple[int, ...]:
    """1, 2, 4, ..., the largest power of two <= max_offset."""
    if max_offset < 1:
        raise MoendError(f"max_offset={max_offset!r}; must be >= 1")
    return tuple(2**i for i in range(int(math.log2(max_offset)) + 1))


def standardise(x: Tensor) -> Tensor:
    """z-score x [B, Hkv, T] over its tokens (a constant row becomes zeros)."""
    mu = x.mean(dim=-1, keepdim=True)
    sd = x.std(dim=-1, keepdim=True, correction=0)
    return (x - mu) / sd.clamp_min(1e-12)


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

    Value norm (``value_weight``, default 1): then ``value_weight`` times the standardised ``||v||`` is added to the
    standardised sum (a token's share of the output is its attention times its value, the observation of
    value-aware pruning): a key that draws average attention but carries a large value moves the output more than
    its score says. Measured (SmolLM2-135M, query-agnostic niah_single at 14x, the greedy plan fixed, 30 examples
    each, ``examples/plan_ablation.py``): 70.0% -> 93.3% at 2k and 73.3% -> 96.7% at 4k, 7 examples better and
    none worse at each length (weight 0.5: 80.0% at 2k, weight 2: 93.3% at 4k). Weight 0.25 (table
    re-calibrated with it, the query-agnostic evaluation re-run, docs/results.md): 14x passkey + niah_single
    86.7% at 2k (91.7% with weight 1) and 88.3% at 4k (80.0%: the late passkey needles come back), but
    niah_single at 8k 55% (75%) and 30% at 20x (75%), so the default stays 1.

    Key novelty (``diversity_weight``, default 0.5): then ``diversity_weight`` times the standardised
    :meth:`novelty` (minus the cosine between a key's pre-RoPE direction and the mean of the layer's keys, KeyDiff's
    signal) is added. Without a query, a fact that is stated once among text that repeats itself (a pass key in
    repeated filler) is the key that points away from the rest; the frequency score, which rates keys by how an
    average query meets them, rates the repeated phrase as high as the fact. Measured (SmolLM2-135M,
    query-agnostic, 14x, the weight-1 table's greedy plan fixed, ``examples/plan_ablation.py``; weights 0 / 0.25 /
    0.5 / 1): passkey 86.7 / 93.3 / 90.0 / 93.3% at 2k and 70.0 / 80.0 / 76.7 / 80.0% at 4k (30 each),
    niah_single 96.7 / 100 / 100 / 100% at 2k, 96.7 / 96.7 / 100 / 93.3% at 4k (30) and 80 / 70 / 80 / 75% at
    8k (20): 0.5 is the one weight no worse than none anywhere. docs/results.md has the evaluation.

    Pooling (default: max over ``kernel_size`` = 9 stored neighbours, as SnapKV pools its attention): a
    retrieved fact is a span ("The pass key is 72207."), and a per-token score keeps some of its tokens and
    drops others; max-pooling keeps the neighbours of every high-scoring token.

    Measured (SmolLM2-135M, query-agnostic passkey at 2k tokens, every layer keeping 12% at 16 bits):
    plain trig 0/4, max-pooled trig 4/4, with the norm term 4/4; keeping 7%: 0/3, 0/3, 3/3 (small samples:
    the evaluation in docs/results.md is the real test). ``pooling="none", norm_weight=0`` gives the plain
    TriAttention-style score (with ``value_weight=0, diversity_weight=0``).

    Stats: ``stats`` (a calibrated :class:`~moend_fx.eviction.query_stats.QueryStats` of this layer, [H] heads) or, if
    None, estimated from ``queries`` un-rotated with ``query_positions`` (per batch row): only then does the
    scorer read queries.
    """

    name: ClassVar[str] = ScorerName.TRIG
    rope: RopeSpec | None = None
    stats: QueryStats | None = field(default=None, compare=False, repr=False)
    max_offset: int = 65536
    offsets: tuple[int, ...] | None = None
    pooling: Pooling = Pooling.MAX
    kernel_size: int = 9
    norm_weight: float = 1.0
    value_weight: float = 1.0
    diversity_weight: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "pooling", check_pooling(self.name, self.pooling, self.kernel_size))
        for name in ("norm_weight", "value_weight", "diversity_weight"):
            w = getattr(self, name)
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not (math.isfinite(w) and w >= 0):
                raise MoendError(f"trig {name}={w!r}; must be a finite number >= 0")
        if not isinstance(self.rope, RopeSpec):
            raise MoendError(
                "the trig scorer needs rope=RopeSpec: use moend_fx.prepare(model, plan), or pass "
                "rope=moend_fx.eviction.rope.rope_from_model(model) (or pick another scorer, e.g. scorer='snapkv'); "
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

    @property
    def needs_queries(self) -> bool:
        """Only to estimate the query statistics on the fly (no calibrated ``stats``)."""
        return self.stats is None

    @classmethod
    def reads_queries(cls, *, calibrated: bool) -> bool:
        return not calibrated

    @classmethod
    def state_bytes(cls, *, num_heads: int, head_dim: int, calibrated: bool) -> int:
        """The calibrated statistics it holds (float64 sums: ``QueryStats.bytes_for``), else nothing."""
        return QueryStats.bytes_for(num_heads, head_dim) if calibrated else 0

    @property
    def calibrated(self) -> bool:
        return self.stats is not None

    def nbytes(self) -> int:
        return 0 if self.stats is None else self.stats.nbytes()

    @classmethod
    def layer_options(cls, *, rope: RopeSpec | None, stats: QueryStats | None, query_window: int) -> dict[str, Any]:
        """The model's RoPE and the layer's calibrated statistics (None: estimated from the query window)."""
        return {"rope": rope, "stats": stats}

    def _query_terms(self, queries: Tensor | None, query_positions: Tensor | None, hkv: int) -> tuple[Tensor, Tensor]:
        """(qbar [B|1, H, F] complex128, E|q| - |qbar| [B|1, H, F] float64) from the stats or the queries
        [B, H, W, D] at query_positions [B, W]."""
        if self.stats is not None:
            qbar, eabs = self.stats.mean[None], self.stats.abs_mean[None]
        else:
            if queries is None or query_positions is None:
                raise MoendError(
                    "trig scorer needs calibrated stats=QueryStats, or queries [B, H, W, D] and "
                    "query_positions [B, W] to estimate them"
                )
            z = to_complex(invert_rope(queries.double(), query_positions, self.rope), self.rope)  # [B, H, W, F]
            qbar, eabs = z.mean(dim=2), z.abs().mean(dim=2)
        if qbar.shape[1] % hkv:
            raise MoendError(f"trig: {qbar.shape[1]} query heads is not a multiple of Hkv={hkv}")
        return qbar, eabs - qbar.abs()

    def _coefficients(self, qbar: Tensor, incoherent: Tensor, t_now: Tensor, hkv: int) -> tuple[Tensor, Tensor]:
        """Per KV head, the averaged rotated mean query c [B|1, Hkv, F] complex and the magnitude weights
        m [B|1, Hkv, F] (see the class docstring); qbar, incoherent: [B|1, H, F]; t_now: [B] float64."""
        g = qbar.shape[1] // hkv
        w = self.rope.pair_freq_tensor(dtype=torch.float64)  # [F] (0 for channels RoPE passes through)
        deltas = torch.tensor(self.offsets, dtype=torch.float64)  # [N]
        ang = deltas[:, None] * w  # [N, F]
        avg_phase = torch.polar(torch.ones_like(ang), ang).mean(dim=0)  # [F]
        # float64 phases: t_now * w reaches 1e5 rad at long contexts
        ang = t_now[:, None] * w
        now_phase = torch.polar(torch.ones_like(ang), ang)  # [B, F]
        s = self.rope.pair_scaling()  # a float, or [F] for a partial RoPE (passed-through pairs are not scaled)
        c = qbar.cpu() * (now_phase * avg_phase)[:, None, :] * s  # [B, H, F]
        c = c.reshape(c.shape[0], hkv, g, -1).mean(dim=2)
        m = (incoherent.cpu() * s).reshape(incoherent.shape[0], hkv, g, -1).mean(dim=2)
        return c, m

    def novelty(self, keys: Tensor, key_positions: Tensor) -> Tensor:
        """How unlike the layer's other keys each key is: minus the cosine between its pre-RoPE direction and the
        mean direction of the keys given (per row and KV head). keys: [B, Hkv, T, D] post-RoPE; key_positions:
        [B, Hkv, T]. Returns [B, Hkv, T] float32 in [-1, 1].

        Pre-RoPE, so that a phrase repeated at many positions is one direction (after RoPE each copy sits at
        its own angle and looks new)."""
        unit = F.normalize(invert_rope(keys.double(), key_positions, self.rope).float(), dim=-1)
        anchor = F.normalize(unit.mean(dim=2, keepdim=True), dim=-1)
        return -(unit * anchor).sum(dim=-1)

    def score(self, keys: Tensor, values: Tensor, *, queries: Tensor | None = None, key_positions: Tensor,
              query_positions: Tensor | None = None) -> Tensor:
        """keys, values: [B, Hkv, T, D]; queries: [B, H, W, D] or None (with stats); key_positions: [B, Hkv, T];
        query_positions: [B, W] or None. Returns [B, Hkv, T] float32."""
        check_keys(keys, values)
        b, hkv, t, d = keys.shape
        if d != self.rope.head_dim:
            raise MoendError(f"trig: keys head_dim {d} != rope head_dim {self.rope.head_dim}")
        kp = as_key_positions(key_positions, keys.shape)
        if queries is not None:
            check_queries(queries, keys, self.name)
        qp = as_query_positions(query_positions, b, queries.shape[2]) if queries is not None else None
        qbar, incoherent = self._query_terms(queries, qp, hkv)

        t_now = kp.reshape(b, -1).amax(dim=1)  # [B]
        if qp is not None:
            t_now = torch.maximum(t_now, qp.amax(dim=1))
        c, m = self._coefficients(qbar, incoherent, (t_now + 1).cpu().double(), hkv)

        k = self.rope.to_canonical(keys.float())  # [re | im] halves (a partial / interleaved RoPE reordered)
        half = d // 2
        # Re(c conj(krot)) = k_re . c_re + k_im . c_im
        cvec = torch.cat((c.real, c.imag), dim=-1).to(device=keys.device, dtype=torch.float32)  # [B, Hkv, D]
        coherent = torch.matmul(k, cvec.expand(b, hkv, d)[..., None])[..., 0]  # [B, Hkv, T]
        kabs = torch.hypot(k[..., :half], k[..., half:])  # |krot_f| = s |k_f|: [B, Hkv, T, F]
        mvec = m.to(device=keys.device, dtype=torch.float32).expand(b, hkv, half)
        magnitude = torch.matmul(kabs, mvec[..., None])[..., 0]
        score = (coherent + magnitude).float()  # [B, Hkv, T]
        if self.norm_weight:
            score = standardise(score) + self.norm_weight * standardise(-k.norm(dim=-1))
        if self.value_weight:
            score = standardise(score) + self.value_weight * standardise(values.float().norm(dim=-1))
        if self.diversity_weight:
            score = standardise(score) + self.diversity_weight * standardise(self.novelty(keys, kp))
        return pool_scores(score, self.kernel_size, self.pooling)
