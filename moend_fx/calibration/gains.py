"""Per-layer gains: how much of a layer's attention-output error reaches the next-token distributions.

``S[l, c]`` is local (the relative error of layer l's attention output), and the paper's proxy adds it over
layers. Measured here, that sum ranks plans by end-to-end KL only moderately (Spearman 0.85 on SmolLM2):
a unit of output error costs up to ~1000x more KL on some layers than on others, and KL grows with the
square of a small logit change, so many small quantization errors are over-predicted against one large
eviction error (docs/calibration.md, "Gains").

For each layer l the calibration sequence's last ``continuation`` tokens are decoded, teacher-forced, against
the compressed prefill of the rest with only layer l compressed with the probe config c0
(:class:`~moend_fx.calibration.continuation.ContinuationKL`), and

    gain[l] = KL_l / S0[l] ** 2

where ``KL_l`` is the mean KL(p_full || p_l) over the continuation and ``S0[l]`` the layer's S at c0 (both
averaged over the calibration sequences). The table then predicts a plan's KL as
``sum_l gain[l] * S[l, c_l] ** 2`` (:attr:`~moend_fx.calibration.sensitivity.SensitivityTable.loss`).
Cost: one more prefill per sequence and, per layer l, a continuation pass through layers l.. only (the layers
before it replay their recorded full-precision outputs: ``ContinuationKL``), about half a full pass on average.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moend_fx.calibration.continuation import ContinuationKL
from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.common.errors import MoendError
from moend_fx.plan.routing import LayerConfig

__all__ = ["RECOMMENDED_PROBE", "GAIN_FLOOR", "continuation_split", "layer_gains"]

RECOMMENDED_PROBE = "keep0.5_k4_v4"
"""The probe of the published gained tables (``moend calibrate --gain-probe keep0.5_k4_v4 --sequences 2``): it
both evicts and quantizes, as the plans at 8-14x do. Of three probes tried on SmolLM2
(keep 0.25 16/16, keep 1.0 K4/V4, this one) it ranked held-out plans best; the three gave gains whose
per-layer order agrees at Spearman 0.86-0.90 (docs/calibration.md)."""

GAIN_FLOOR = 1e-3
"""Smallest gain, as a fraction of the median gain: a layer whose probe changed the continuation by no
measurable KL still orders its own configs by S (a gain of 0 would make every config of it free)."""


def continuation_split(tokens: int, window: int) -> tuple[int, int]:
    """(context, continuation) of a calibration sequence of ``tokens`` tokens: the last ``window`` tokens (the
    queries S is measured on), at most half the sequence, are the continuation."""
    cont = min(window, tokens // 2)
    if cont < 1:
        raise MoendError(f"a calibration sequence of {tokens} tokens is too short to measure gains; "
                         "allowed: tokens >= 2 (or calibrate without gains)")
    return tokens - cont, cont


def layer_gains(model: Any, table: SensitivityTable, token_ids: torch.Tensor, probe: LayerConfig,
                probe_errors: np.ndarray, *, window: int, progress: bool = False) -> np.ndarray:
    """[L] float64 gains of ``table``'s layers (see the module docstring).

    token_ids: [N, T] the calibration sequences; probe_errors: [L] the mean S of each layer at ``probe``;
    window: the calibration window (the continuation is the last ``window`` tokens, at most T // 2).
    """
    from tqdm.auto import tqdm

    if probe.lossless:
        raise MoendError(f"gain probe {probe.name} is lossless; it must compress (evict or quantize)")
    num_layers = table.num_layers
    context, _ = continuation_split(int(token_ids.shape[1]), window)
    lossless = LayerConfig(1.0, 16, 16)
    kl = np.zeros(num_layers, dtype=np.float64)
    bar = tqdm(total=num_layers * token_ids.shape[0], desc="calibrate gains (layers x sequences)",
               disable=not progress, unit="layer")
    try:
        for s in range(token_ids.shape[0]):
            seq = ContinuationKL(model, table, token_ids[s], context, min(window, context))
            for l in range(num_layers):
                kl[l] += seq.kl(tuple(probe if i == l else lossless for i in range(num_layers)))
                bar.update(1)
            del seq
    finally:
        bar.close()
    kl /= token_ids.shape[0]
    err2 = np.asarray(probe_errors, dtype=np.float64) ** 2
    if err2.shape != (num_layers,) or not (err2 > 0).all():
        raise MoendError(f"probe {probe.name} left some layer's attention output unchanged (S = 0): its gain is "
                         "undefined; pick a probe that compresses more")
    gain = np.maximum(kl, 0.0) / err2
    floor = GAIN_FLOOR * float(np.median(gain))
    if floor <= 0:
        raise MoendError(f"probe {probe.name} changed the continuation on at most half of the layers (KL = 0): "
                         "the gains are undefined; calibrate on more tokens or without gains")
    return np.maximum(gain, floor)
