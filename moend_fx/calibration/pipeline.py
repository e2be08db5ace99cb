"""Calibration: measure ``S[l, c]`` for every layer and grid config on real text (MoE-nD's offline step).

Per calibration sequence: one prefill with :class:`~moend_fx.calibration.capture.AttentionCapture` records, per layer,
post-RoPE K/V, the last ``window`` queries and the pre-RoPE query statistics. Then, one layer at a time:

1. score the tokens once (``trig`` by default, with the statistics accumulated so far);
2. for each keep ratio, select tokens exactly as the cache does (``scoring.select_tokens``: sinks, recent
   window, best scores) and gather them with their original positions;
3. compress the kept K for each K bit width and the kept V for each V bit width with
   :meth:`PackedKV.from_dense` + ``dequantize`` (so the table sees exactly what the cache stores, residual
   window included);
4. for every (K bits, V bits) pair compute the window queries' attention over the compressed K/V (softmax
   shared per K bits), masked by position (a query sees kept keys at or before its own position), and
   take the relative L2 error against the same computation on the uncompressed K/V.

``S`` is the mean over sequences. Memory: one sequence's captures (O(L * T * D)), freed layer by layer;
attention is O(W * T) per layer, never O(T^2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moend_fx.calibration.capture import AttentionCapture, LayerCapture
from moend_fx.calibration.data import token_sequences
from moend_fx.calibration.sensitivity import SensitivityTable, stats_to_arrays
from moend_fx.common.errors import MoendError
from moend_fx.eviction.rope import QueryStats, RopeSpec, rope_from_model
from moend_fx.eviction.scoring import get_scorer, select_tokens
from moend_fx.plan.memory import keep_count
from moend_fx.plan.routing import ALLOWED_SCORERS, Grid, LayerConfig, ModelFingerprint
from moend_fx.storage.packed import PackedKV


@dataclass(frozen=True)
class CalibrationSettings:
    """How a table was calibrated (stored in the table's metadata)."""

    tokens: int = 2048
    num_sequences: int = 1
    seed: int = 0
    scorer: str = "trig"
    window: int = 64
    group_size: int = 32
    sink_tokens: int = 4
    recent_tokens: int = 32

    def __post_init__(self) -> None:
        for name in ("tokens", "num_sequences", "window", "group_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise MoendError(f"{name}={v!r} is invalid; allowed: a positive integer")
        for name in ("sink_tokens", "recent_tokens", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise MoendError(f"{name}={v!r} is invalid; allowed: an integer >= 0")
        if self.group_size & (self.group_size - 1):
            raise MoendError(f"group_size={self.group_size} is invalid; allowed: a power of two")
        if self.scorer not in ALLOWED_SCORERS:
            raise MoendError(f"scorer={self.scorer!r} is unknown; allowed: {list(ALLOWED_SCORERS)}")

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _body(model: Any) -> Any:
    """The transformer without its LM head (``model.base_model``), else the model itself."""
    body = getattr(model, "base_model", None)
    return body if body is not None and body is not model else model


def build_scorer(name: str, rope: RopeSpec | None, stats: QueryStats | None, window: int) -> Any:
    """The eviction scorer for one layer: ``trig`` gets the RoPE and the calibrated statistics."""
    if name == "trig":
        return get_scorer("trig", rope=rope, stats=stats)
    if name == "snapkv":
        return get_scorer("snapkv", window=window)
    return get_scorer(name)


def scorer_options(name: str) -> dict[str, Any]:
    """The scorer's default options (JSON-ready): recorded in a table, so a table calibrated with another
    version of the scorer is recognised (:func:`stale_reason`). Needs no RoPE or stats."""
    import dataclasses

    from moend_fx.eviction.scoring import SCORERS

    skip = {"rope", "stats", "offsets"}
    return {f.name: f.default for f in dataclasses.fields(SCORERS[name])
            if f.init and f.name not in skip and f.default is not dataclasses.MISSING}


def stale_reason(table: Any) -> str | None:
    """Why ``table`` was calibrated with other scorer options than this version's defaults (None if current).

    The cache scores tokens with the current defaults, so a table measured with older ones mis-predicts
    what eviction costs: recalibrate it (``moend calibrate``)."""
    cal = table.calibration
    name = str(cal.get("scorer", "trig"))
    if name not in ALLOWED_SCORERS:
        return None
    want = scorer_options(name)
    got = cal.get("scorer_options")
    if got != want:
        return (f"the table was calibrated with {name} scorer options {got}, this version uses {want}; "
                "recalibrate it with `moend calibrate`")
    return None


def window_attention(q: torch.Tensor, k: torch.Tensor, values: list[torch.Tensor], allowed: torch.Tensor,
                     scale: float) -> list[torch.Tensor]:
    """Attention of q over k and each of several V's, sharing one softmax.

    q: [B, H, W, D]; k: [B, Hkv, n, D]; values: list of [B, Hkv, n, D]; allowed: bool [B, Hkv, 1|G, W, n]
    (True = may attend). Returns one [B, Hkv, G, W, D] float32 output per V (G = H / Hkv, GQA order).
    """
    b, h, w, d = q.shape
    hkv = k.shape[1]
    qf = q.float().reshape(b, hkv, h // hkv, w, d)
    logits = torch.matmul(qf, k.float().unsqueeze(2).transpose(-1, -2)) * scale  # [B, Hkv, G, W, n]
    logits = logits.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return [torch.matmul(probs, v.float().unsqueeze(2)) for v in values]


def _rel_err(out: torch.Tensor, ref: torch.Tensor, ref_norm: float) -> float:
    return float((out.double() - ref.double()).norm()) / ref_norm


def _kept(cap: LayerCapture, scores: torch.Tensor, keep: float, sink: int, recent: int,
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Kept K, V [B, Hkv, n, D] and positions [B, Hkv, n] (None when nothing is evicted)."""
    b, hkv, t, _ = cap.keys.shape
    n = keep_count(t, keep)
    if n >= t:
        return cap.keys, cap.values, None
    kp = cap.key_positions[:, None, :].expand(b, hkv, t)
    idx, pos = select_tokens(scores, n, sink_tokens=sink, recent_tokens=recent, key_positions=kp)
    gi = idx[..., None].expand(-1, -1, -1, cap.keys.shape[-1])
    return cap.keys.gather(2, gi), cap.values.gather(2, gi), pos


def compress_side(k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor | None, keep: float, bits: int,
                  side: str, group_size: int) -> torch.Tensor:
    """K (side "k") or V (side "v") of kept tokens k, v [B, Hkv, n, D] after the cache's compression.

    The other side is left at 16 bits: with a quantized config the packed/residual split is the same
    whatever the other side's bits, and a 16-bit side is stored as is, so K's error depends only on K bits.
    """
    if bits == 16:
        return k if side == "k" else v
    cfg = LayerConfig(keep, bits, 16) if side == "k" else LayerConfig(keep, 16, bits)
    kk, vv = PackedKV.from_dense(k, v, cfg, group_size, pos).dequantize(k.dtype)
    return kk if side == "k" else vv


def layer_errors(cap: LayerCapture, grid: Grid, scorer: Any, *, group_size: int = 32, sink_tokens: int = 4,
                 recent_tokens: int = 32) -> np.ndarray:
    """Relative L2 error of the window queries' attention output for every grid config: [C] float64."""
    b, hkv, t, _ = cap.keys.shape
    q, qpos = cap.queries, cap.query_positions  # [B, H, W, D], [B, W]

    def allowed_for(pos: torch.Tensor | None) -> torch.Tensor:
        kp = cap.key_positions[:, None, :].expand(b, hkv, t) if pos is None else pos
        return (kp[:, :, None, None, :] <= qpos[:, None, None, :, None])  # [B, Hkv, 1, W, n]

    (ref,) = window_attention(q, cap.keys, [cap.values], allowed_for(None), cap.scaling)
    ref_norm = float(ref.double().norm())
    if ref_norm == 0.0:
        raise MoendError("the attention output of the calibration window is all zeros; cannot measure "
                         "relative errors (check the model and the input)")
    needs_scores = any(keep_count(t, kr) < t for kr in grid.keep_ratios)
    scores = None
    if needs_scores:
        kp = cap.key_positions[:, None, :].expand(b, hkv, t)
        scores = scorer.score(cap.keys, cap.values, queries=q, key_positions=kp, query_positions=qpos)
    errs: dict[LayerConfig, float] = {}
    for keep in grid.keep_ratios:
        k, v, pos = _kept(cap, scores, keep, sink_tokens, recent_tokens)
        allowed = allowed_for(pos)
        vs = [compress_side(k, v, pos, keep, vb, "v", group_size) for vb in grid.v_bits]
        for kb in grid.k_bits:
            kk = compress_side(k, v, pos, keep, kb, "k", group_size)
            outs = window_attention(q, kk, vs, allowed, cap.scaling)
            for vb, out in zip(grid.v_bits, outs):
                errs[LayerConfig(keep, kb, vb)] = _rel_err(out, ref, ref_norm)
    return np.array([errs[c] for c in grid.configs], dtype=np.float64)


def calibrate(
    model: Any,
    tokenizer: Any | None = None,
    *,
    token_ids: torch.Tensor | None = None,
    grid: Grid | None = None,
    settings: CalibrationSettings | None = None,
    progress: bool = False,
    **overrides: Any,
) -> SensitivityTable:
    """Measure the sensitivity table of ``model``.

    token_ids: [N, T] calibration sequences; if None, ``settings.num_sequences`` sequences of
    ``settings.tokens`` tokens are built by :func:`moend_fx.calibration.data.token_sequences` (licence texts +
    synthetic records with a tokenizer; seeded random ids without one). Keyword ``overrides`` replace fields of
    ``settings`` (e.g. ``calibrate(model, tok, tokens=1024, scorer="snapkv")``).
    """
    settings = settings or CalibrationSettings()
    if overrides:
        bad = sorted(set(overrides) - set(CalibrationSettings.__dataclass_fields__))
        if bad:
            raise MoendError(f"calibrate() got unknown option(s) {bad}; allowed: "
                             f"{sorted(CalibrationSettings.__dataclass_fields__)}")
        settings = CalibrationSettings(**{**settings.to_dict(), **overrides})
    grid = grid or Grid()
    fp = ModelFingerprint.from_model(model)
    if token_ids is None:
        token_ids, source = token_sequences(model, tokenizer, settings.num_sequences, settings.tokens,
                                            seed=settings.seed, split="calibration")
    else:
        token_ids = torch.as_tensor(token_ids)
        if token_ids.dim() != 2 or token_ids.shape[1] < 2 or token_ids.dtype.is_floating_point:
            raise MoendError(f"token_ids must be an integer [N, T] tensor with T >= 2; got "
                             f"{tuple(token_ids.shape)} {token_ids.dtype}")
        settings = CalibrationSettings(**{**settings.to_dict(), "tokens": int(token_ids.shape[1]),
                                          "num_sequences": int(token_ids.shape[0])})
        source = {"kind": "token_ids"}
    rope = rope_from_model(model)
    stats: dict[int, QueryStats] = {}
    total = np.zeros((fp.num_layers, len(grid)), dtype=np.float64)
    device = next(model.parameters()).device
    from tqdm.auto import tqdm

    bar = tqdm(total=fp.num_layers * token_ids.shape[0], desc="calibrate (layers x sequences)",
               disable=not progress, unit="layer")
    try:
        for s in range(token_ids.shape[0]):
            cap = AttentionCapture(model, window=settings.window, rope=rope, stats=stats)
            with torch.no_grad(), cap:
                # the base model only: the LM head over every prefill token is wasted work here
                _body(model)(input_ids=token_ids[s:s + 1].to(device), use_cache=False)
            with torch.no_grad():
                for layer in range(fp.num_layers):
                    lc = cap.pop(layer)
                    scorer = build_scorer(settings.scorer, rope, stats.get(layer), settings.window)
                    total[layer] += layer_errors(lc, grid, scorer, group_size=settings.group_size,
                                                 sink_tokens=settings.sink_tokens,
                                                 recent_tokens=settings.recent_tokens)
                    del lc
                    bar.update(1)
    finally:
        bar.close()
    S = total / token_ids.shape[0]
    calibration = {**settings.to_dict(), "scorer_options": scorer_options(settings.scorer),
                   "context_length": settings.tokens, "source": source,
                   "metric": "relative L2 error of the attention output of the last `window` queries, "
                             "one layer compressed at a time"}
    return SensitivityTable(S=S, grid=grid, fingerprint=fp, group_size=settings.group_size,
                            calibration=calibration, query_stats=stats_to_arrays(stats))
