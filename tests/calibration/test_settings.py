"""CalibrationSettings' checks and stale_reason on a version-3 table (calibration v4 added the retrieval tail)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from moend_fx.calibration.settings import CALIBRATION_VERSION, CalibrationSettings, scorer_options, stale_reason
from moend_fx.common.errors import MoendError
from moend_fx.common.options import ScorerName


def test_retrieval_tails_range():
    with pytest.raises(MoendError, match=r"retrieval_tails=3 is invalid with num_sequences=2; allowed: 0 to 2"):
        CalibrationSettings(retrieval_tails=3)
    with pytest.raises(MoendError, match="retrieval_tails=-1"):
        CalibrationSettings(retrieval_tails=-1)
    assert CalibrationSettings(num_sequences=4, retrieval_tails=4).retrieval_tails == 4
    assert CalibrationSettings(num_sequences=1).retrieval_tails is None  # the default: every sequence


def test_a_version_3_table_is_stale_and_says_what_changed():
    # stale_reason reads only the table's calibration metadata
    current = {**CalibrationSettings().to_dict(), "version": CALIBRATION_VERSION,
               "scorer_options": scorer_options(ScorerName.TRIG)}
    assert CALIBRATION_VERSION == 4 and stale_reason(SimpleNamespace(calibration=current)) is None
    why = stale_reason(SimpleNamespace(calibration={**current, "version": 3}))
    assert "version 3" in why and "retrieval tail" in why and "moend calibrate" in why
