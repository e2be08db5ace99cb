"""Per-layer gains (moend_fx.calibration.gains) on tiny random-weight models: the definition, the options, errors."""

from __future__ import annotations

import numpy as np
import pytest

from moend_fx.calibration.continuation import ContinuationKL
from moend_fx.calibration.data import random_token_sequences
from moend_fx.calibration.gains import continuation_split
from moend_fx.calibration.pipeline import CalibrationSettings, calibrate, stale_reason
from moend_fx.common.errors import MoendError, PlanError
from moend_fx.models import tiny_model
from moend_fx.plan.routing import Grid, LayerConfig

TINY = dict(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", **TINY, seed=2)


@pytest.fixture(scope="module")
def ids(model):
    return random_token_sequences(model.config.vocab_size, 2, 160, seed=4)[0]


@pytest.fixture(scope="module")
def table(model, ids):
    return calibrate(model, token_ids=ids, gain_probe="keep0.5_k4_v4")


def test_gain_times_probe_error_squared_is_the_one_layer_kl(model, ids, table):
    """gain[l] * S0[l]**2 is the end-to-end KL of compressing layer l alone with the probe (mean over the
    sequences), re-measured here with ContinuationKL on the same split; float64 KLs of the same computation."""
    info = table.calibration["gains"]
    probe = LayerConfig.from_name(info["probe"])
    assert probe == LayerConfig(0.5, 4, 4) and (info["context"], info["continuation"]) == (96, 64)
    s0 = np.array(info["probe_S"])
    assert (s0 > 0).all()
    lossless = LayerConfig(1.0, 16, 16)
    seqs = [ContinuationKL(model, table, ids[s], 96, 64) for s in range(2)]
    for l in range(3):
        plan = tuple(probe if i == l else lossless for i in range(3))
        kl = np.mean([seq.kl(plan) for seq in seqs])
        assert table.gain[l] * s0[l] ** 2 == pytest.approx(kl, rel=1e-9)
    # the predicted loss of that one-layer plan is its measured KL: rel 1e-6 for the lossless layers' own loss
    # (an fp32 model's K/V stored in fp16: S ~ 1e-4, so gain * S**2 ~ 1e-8 of the probe's)
    assert table.predicted_loss(plan) == pytest.approx(kl, rel=1e-6)


def test_gains_differ_across_layers_and_are_positive(table):
    assert table.gain.shape == (3,) and (table.gain > 0).all()
    assert table.gain.max() / table.gain.min() > 1.5  # random layers do not pass their error on alike
    np.testing.assert_array_equal(table.loss, table.gain[:, None] * table.S ** 2)


def test_probe_outside_the_grid_and_no_gains(model, ids):
    grid = Grid((0.5, 1.0), (16,), (16,))
    t = calibrate(model, token_ids=ids[:1, :96], grid=grid, gain_probe="keep0.25_k2_v2")
    assert t.gain is not None and t.S.shape == (3, 2) and len(t.calibration["gains"]["probe_S"]) == 3
    assert t.calibration["gains"]["continuation"] == 48  # at most half of a short sequence
    plain = calibrate(model, token_ids=ids[:1, :96], grid=grid, gain_probe=None)
    assert plain.gain is None and plain.calibration["gains"] is None and plain.loss is plain.S
    np.testing.assert_array_equal(plain.S, t.S)  # gains change nothing in S


def test_bad_probes_are_refused():
    with pytest.raises(MoendError, match="lossless"):
        CalibrationSettings(gain_probe="keep1_k16_v16")
    with pytest.raises(PlanError, match="keep<ratio>_k<bits>_v<bits>"):
        CalibrationSettings(gain_probe="half")
    with pytest.raises(PlanError, match="allowed: \\[2, 4, 8, 16\\]"):
        CalibrationSettings(gain_probe="keep0.5_k3_v4")
    assert CalibrationSettings(gain_probe="keep0.50_k4_v4").gain_probe == "keep0.5_k4_v4"


def test_continuation_split():
    assert continuation_split(2048, 64) == (1984, 64)
    assert continuation_split(96, 64) == (48, 48)
    with pytest.raises(MoendError, match="too short"):
        continuation_split(1, 64)


def test_a_table_from_the_calibration_before_gains_is_stale(table):
    """Gains are the default since version 3: a version-2 table (no gains) is stale; a current table without
    gains (``gain_probe=None``, asked for) is not."""
    import dataclasses

    old = dataclasses.replace(table, calibration={**table.calibration, "version": 2}, gain=None)
    assert "version 2" in stale_reason(old) and "gains" in stale_reason(old)
    assert stale_reason(table) is None and stale_reason(dataclasses.replace(table, gain=None)) is None
