"""Calibration: measure ``S[l, c]`` for every layer and grid config on real text (MoE-nD's offline step).

Per calibration sequence: one prefill with :class:`~moend_fx.calibration.capture.AttentionCapture` records, per layer,
post-RoPE K/V, the last ``window`` queries and the pre-RoPE query statistics. Then, one layer at a time:

1. score the tokens once (``trig`` by default, with the statistics accumulated so far), with the scorer built
   as the cache builds it (:func:`moend_fx.eviction.scorers.build_scorer`: same options, same query window);
2. for each keep ratio, select tokens exactly as the cache does (``selection.select_tokens``: sinks, recent
   window, best scores) and gather them with their original positions;
3. compress the kept K for each K bit width and the kept V for each V bit width with
   :meth:`PackedKV.from_dense` + ``dequantize`` (so the table sees exactly what the cache stores, the 16-bit
   residual window and 16-bit sides included);
4. for every (K bits, V bits) pair compute the window queries' attention over the compressed K/V (softmax
   shared per K bits), masked by position (a query sees kept keys at or before its own position), and
   take the relative L2 error against the same computation on the uncompressed K/V (``measure="l2"``, the
   default); or, with ``measure="top1"``, the share of (query, head) rows whose highest-logit key over the
   compressed K is not the one over the uncompressed K (V plays no part).

``S`` is the mean over sequences, made monotone in keep ratio (:mod:`moend_fx.calibration.monotone`); per-layer
gains follow (:mod:`moend_fx.calibration.gains`; ``gain_probe=None`` skips them). Trig's query statistics
exclude the measured window. Memory: one sequence's captures, freed per layer; attention O(W * T), never O(T^2).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from moend_fx.calibration.capture import AttentionCapture, LayerCapture
from moend_fx.calibration.data import token_sequences
from moend_fx.calibration.gains import continuation_split, layer_gains
from moend_fx.calibration.monotone import monotone_in_keep
from moend_fx.calibration.prefill import kept_tokens, model_body
from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.calibration.settings import CALIBRATION_VERSION, CalibrationSettings, scorer_options, stale_reason
from moend_fx.calibration.stats_arrays import stats_to_arrays
from moend_fx.common.defaults import GROUP_SIZE, RECENT_TOKENS, SINK_TOKENS
from moend_fx.common.errors import MoendError
from moend_fx.common.options import SensitivityMeasure
from moend_fx.eviction.query_stats import QueryStats
from moend_fx.eviction.rope import rope_from_model
from moend_fx.eviction.scorers import SCORERS, build_scorer
from moend_fx.plan.families import check_family
from moend_fx.plan.memory import keep_count, sliding_kept
from moend_fx.plan.routing import Grid, LayerConfig, ModelFingerprint
from moend_fx.storage.packed import PackedKV

__all__ = ["CalibrationSettings", "calibrate", "compress_side", "layer_errors", "scorer_options",
           "stale_reason", "window_attention"]


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


def window_top1(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The position of each window query's highest-logit allowed key: q [B, H, W, D]; k [B, Hkv, n, D]; positions
    [B, Hkv, n] of those keys; allowed: bool [B, Hkv, 1|G, W, n]. Returns [B, Hkv, G, W] int64 (GQA order).
    The softmax scale does not move an argmax, so none is applied."""
    b, h, w, d = q.shape
    hkv = k.shape[1]
    logits = torch.matmul(q.float().reshape(b, hkv, h // hkv, w, d), k.float().unsqueeze(2).transpose(-1, -2))
    best = logits.masked_fill(~allowed, float("-inf")).argmax(dim=-1)  # [B, Hkv, G, W]
    return positions[:, :, None, :].expand(b, hkv, h // hkv, positions.shape[-1]).gather(-1, best)


def _rel_err(out: torch.Tensor, ref: torch.Tensor, ref_norm: float) -> float:
    return float((out.double() - ref.double()).norm()) / ref_norm


def compress_side(k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor | None, keep: float, bits: int,
                  side: str, group_size: int) -> torch.Tensor:
    """K (side "k") or V (side "v") of kept tokens k, v [B, Hkv, n, D] after the cache's compression.

    The other side is left at 16 bits: with a quantized config the packed/residual split is the same
    whatever the other side's bits, and a 16-bit side is stored as is (in its 16-bit storage type, which
    ``PackedKV`` rounds to here too), so K's error depends only on K bits.
    """
    cfg = LayerConfig(keep, bits, 16) if side == "k" else LayerConfig(keep, 16, bits)
    kk, vv = PackedKV.from_dense(k, v, cfg, group_size, pos).dequantize(k.dtype)
    return kk if side == "k" else vv


def layer_errors(cap: LayerCapture, grid: Grid, scorer: Any, *, group_size: int = GROUP_SIZE,
                 sink_tokens: int = SINK_TOKENS, recent_tokens: int = RECENT_TOKENS,
                 extra: tuple[LayerConfig, ...] = (), measure: str = SensitivityMeasure.L2,
                 sliding_window: int = 0) -> np.ndarray:
    """Relative L2 error of the window queries' attention output (``measure="l2"``) or their top-1 key miss rate
    (``"top1"``, see the module docstring) for every grid config, then for each config of ``extra`` (configs
    outside the grid, e.g. the gain probe): [C + len(extra)] float64. ``sliding_window``: a sliding layer's
    window (0: full attention); its queries then attend to their last ``sliding_window`` keys only, as in the
    model, so its K / V bits are measured on the tokens it holds, whatever the calibration length, and a keep
    ratio narrows that window to its most recent ``sliding_kept`` tokens, as the cache does."""
    axes = [(getattr(grid, f), [getattr(c, n) for c in extra]) for f, n in
            (("keep_ratios", "keep_ratio"), ("k_bits", "k_bits"), ("v_bits", "v_bits"))]
    measured = Grid(*(vals + tuple(dict.fromkeys(m for m in more if m not in vals)) for vals, more in axes))
    b, hkv, t, _ = cap.keys.shape
    q, qpos = cap.queries, cap.query_positions  # [B, H, W, D], [B, W]

    def allowed_for(pos: torch.Tensor | None, window: int = sliding_window) -> torch.Tensor:
        kp = cap.key_positions[:, None, :].expand(b, hkv, t) if pos is None else pos
        kp, qp = kp[:, :, None, None, :], qpos[:, None, None, :, None]
        allowed = kp <= qp  # [B, Hkv, 1, W, n]
        return allowed & (kp > qp - window) if window else allowed

    top1 = SensitivityMeasure(measure) == SensitivityMeasure.TOP1
    full_pos = cap.key_positions[:, None, :].expand(b, hkv, t)
    ref_top = window_top1(q, cap.keys, full_pos, allowed_for(None)) if top1 else None
    (ref,) = window_attention(q, cap.keys, [cap.values], allowed_for(None), cap.scaling)
    ref_norm = float(ref.double().norm())
    if ref_norm == 0.0:
        raise MoendError("the attention output of the calibration window is all zeros; cannot measure "
                         "relative errors (check the model and the input)")
    needs_scores = not sliding_window and any(keep_count(t, kr, floor=sink_tokens + recent_tokens) < t
                                              for kr in measured.keep_ratios)
    scores = None
    if needs_scores:
        kp = cap.key_positions[:, None, :].expand(b, hkv, t)
        scores = scorer.score(cap.keys, cap.values, queries=q, key_positions=kp, query_positions=qpos)
    errs: dict[LayerConfig, float] = {}
    for keep in measured.keep_ratios:
        if sliding_window:  # a keep ratio narrows the window to its most recent tokens (moend_fx.cache.sliding)
            k, v, pos, packed_keep = cap.keys, cap.values, None, 1.0
            allowed = allowed_for(None, sliding_kept(min(t, sliding_window - 1), keep) + 1)
        else:
            (k, v, pos), packed_keep = kept_tokens(cap, scores, keep, sink_tokens, recent_tokens), keep
            allowed = allowed_for(pos)
        if top1:
            for kb in measured.k_bits:
                kk = compress_side(k, v, pos, packed_keep, kb, "k", group_size)
                got = window_top1(q, kk, full_pos if pos is None else pos, allowed)
                miss = float((got != ref_top).double().mean())
                errs.update({LayerConfig(keep, kb, vb): miss for vb in measured.v_bits})
            continue
        vs = [compress_side(k, v, pos, packed_keep, vb, "v", group_size) for vb in measured.v_bits]
        for kb in measured.k_bits:
            kk = compress_side(k, v, pos, packed_keep, kb, "k", group_size)
            outs = window_attention(q, kk, vs, allowed, cap.scaling)
            for vb, out in zip(measured.v_bits, outs):
                errs[LayerConfig(keep, kb, vb)] = _rel_err(out, ref, ref_norm)
    return np.array([errs[c] for c in grid.configs + tuple(extra)], dtype=np.float64)


def _settings_and_tokens(model: Any, tokenizer: Any | None, token_ids: torch.Tensor | None,
                         settings: CalibrationSettings | None, overrides: dict[str, Any],
                         ) -> tuple[CalibrationSettings, torch.Tensor, dict[str, Any]]:
    """calibrate()'s settings with ``overrides`` applied, the token ids [N, T] and a description of their source."""
    settings = settings or CalibrationSettings()
    if overrides:
        bad = sorted(set(overrides) - set(CalibrationSettings.__dataclass_fields__))
        if bad:
            raise MoendError(f"calibrate() got unknown option(s) {bad}; allowed: "
                             f"{sorted(CalibrationSettings.__dataclass_fields__)}")
        settings = CalibrationSettings(**{**settings.to_dict(), **overrides})
    if token_ids is None:
        token_ids, source = token_sequences(model, tokenizer, settings.num_sequences, settings.tokens,
                                            seed=settings.seed, split="calibration",
                                            tail=0 if settings.retrieval_tails == 0 else settings.window,
                                            tail_sequences=settings.retrieval_tails)
        return settings, token_ids, source
    token_ids = torch.as_tensor(token_ids)
    if token_ids.dim() != 2 or token_ids.shape[1] < 2 or token_ids.dtype.is_floating_point:
        raise MoendError(f"token_ids must be an integer [N, T] tensor with T >= 2; got "
                         f"{tuple(token_ids.shape)} {token_ids.dtype}")
    settings = CalibrationSettings(**{**settings.to_dict(), "tokens": int(token_ids.shape[1]),
                                      "num_sequences": int(token_ids.shape[0]), "retrieval_tails": 0})
    return settings, token_ids, {"kind": "token_ids"}


def _summed_errors(model: Any, token_ids: torch.Tensor, grid: Grid, settings: CalibrationSettings,
                   stats: dict[int, QueryStats], progress: bool) -> np.ndarray:
    """Sum over the sequences token_ids [N, T] of every layer's :func:`layer_errors`: [L, C (+1 with a gain
    probe, last)] float64. ``stats`` (layer -> QueryStats) accumulates the pre-RoPE query statistics along the
    way."""
    extra = () if settings.probe is None else (settings.probe,)
    from tqdm.auto import tqdm

    fp = ModelFingerprint.from_model(model)
    num_layers = fp.num_layers
    rope = rope_from_model(model)
    total = np.zeros((num_layers, len(grid) + len(extra)), dtype=np.float64)
    device = next(model.parameters()).device
    bar = tqdm(total=num_layers * token_ids.shape[0], desc="calibrate (layers x sequences)",
               disable=not progress, unit="layer")
    try:
        for s in range(token_ids.shape[0]):
            cap = AttentionCapture(model, window=settings.window, rope=rope, stats=stats)
            with torch.no_grad(), cap:
                # the base model only: the LM head over every prefill token is wasted work here
                model_body(model)(input_ids=token_ids[s:s + 1].to(device), use_cache=False)
            with torch.no_grad():
                for layer in range(num_layers):
                    lc = cap.pop(layer)
                    scorer = build_scorer(settings.scorer, rope=rope, stats=stats.get(layer))
                    total[layer] += layer_errors(lc, grid, scorer, group_size=settings.group_size,
                                                 sink_tokens=settings.sink_tokens,
                                                 recent_tokens=settings.recent_tokens, extra=extra,
                                                 measure=settings.measure,
                                                 sliding_window=fp.sliding_window if fp.is_sliding(layer) else 0)
                    del lc
                    bar.update(1)
    finally:
        bar.close()
    return total


_METRIC = {
    SensitivityMeasure.L2: "relative L2 error of the attention output of the last `window` queries, one layer "
                           "compressed at a time",
    SensitivityMeasure.TOP1: "share of the last `window` queries' (query, head) rows whose highest-logit key "
                             "changes, one layer compressed at a time",
}


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
    check_family(model)  # one clear error for a family moend_fx cannot serve (moend_fx.plan.families)
    settings, token_ids, source = _settings_and_tokens(model, tokenizer, token_ids, settings, overrides)
    grid = grid or Grid()
    fp = ModelFingerprint.from_model(model)
    stats: dict[int, QueryStats] = {}
    errors = _summed_errors(model, token_ids, grid, settings, stats, progress) / token_ids.shape[0]
    S, monotone = monotone_in_keep(errors[:, :len(grid)], grid)
    probe = settings.probe
    gains = None
    if probe is not None:
        context, cont = continuation_split(settings.tokens, settings.window)
        gains = {"probe": probe.name, "probe_S": errors[:, -1].tolist(), "context": context, "continuation": cont}
    calibration = {**settings.to_dict(), "version": CALIBRATION_VERSION,
                   "scorer_options": scorer_options(settings.scorer), "monotone": monotone,
                   "setting": str(SCORERS[settings.scorer].setting),
                   "context_length": settings.tokens, "source": source,
                   "metric": _METRIC[SensitivityMeasure(settings.measure)],
                   "gains": gains}
    table = SensitivityTable(S=S, grid=grid, fingerprint=fp, group_size=settings.group_size,
                             calibration=calibration, query_stats=stats_to_arrays(stats))
    if probe is None:
        return table
    # measured with the table's own scorer and statistics, as the cache will evict
    gain = layer_gains(model, table, token_ids, probe, errors[:, -1], window=settings.window, progress=progress)
    return dataclasses.replace(table, gain=gain)
